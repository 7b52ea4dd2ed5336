"""``hf-paged train-eagle``: distil an EAGLE-3 head for a model (:mod:`hf_paged.train.eagle`)."""

from __future__ import annotations

import argparse


def add_parser(sub, fmt, positive_int) -> None:
    p = sub.add_parser("train-eagle", formatter_class=fmt,
                       help="train an EAGLE-3 draft head on text the model writes itself (docs/speculative_decoding.md)")
    p.add_argument("--model", help="local transformers model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="the target's dtype while generating")
    p.add_argument("--out", required=True, help="folder for the head (config.json, model.safetensors), its training "
                   "data and its resumable state")
    p.add_argument("--tokens", type=positive_int, default=20000, help="answer tokens to generate and train on")
    p.add_argument("--prompts", help="JSONL of prompts ({\"messages\": [...]} or {\"prompt\": ...}); default: the "
                   "200 shipped ones")
    p.add_argument("--max-tokens", type=positive_int, default=192, help="longest answer")
    p.add_argument("--draft-vocab-size", type=positive_int, default=8192, help="tokens the head drafts from")
    p.add_argument("--epochs", type=positive_int, default=2, help="passes over the texts")
    p.add_argument("--ttt-steps", type=positive_int, default=3, help="unrolled drafting steps per position")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (cosine decay, short warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=positive_int, help="stop after this many texts in all (run again to resume)")
    p.add_argument("--greedy-first", action="store_true", help="answer every prompt greedily first, then "
                   "sample (default: greedy and sampled answers alternate)")
    p.add_argument("--init-layer", action=argparse.BooleanOptionalAction, default=True,
                   help="start the head's layer from the target's last decoder layer (--no-init-layer: at random)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train_eagle)


def cmd_train_eagle(args: argparse.Namespace) -> int:
    import os

    from hf_paged.cli.checks import UsageError, check_model_folder
    from hf_paged.cli.engine import load
    from hf_paged.train.eagle import TrainConfig, train_eagle
    from hf_paged.train.eagle_data import read_prompts

    config = TrainConfig(tokens=args.tokens, max_tokens=args.max_tokens, draft_vocab_size=args.draft_vocab_size,
                         epochs=args.epochs, ttt_steps=args.ttt_steps, lr=args.lr, seed=args.seed,
                         max_steps=args.max_steps, greedy_first=args.greedy_first, init_layer=args.init_layer)
    if args.prompts and not os.path.isfile(args.prompts):
        raise UsageError(f"--prompts {args.prompts!r}: no such file")
    prompts = read_prompts(args.prompts) if args.prompts else None
    check_model_folder(args.model)
    args.quantization = None
    model, tokenizer = load(args)
    train_eagle(model, tokenizer, args.out, config, prompts, progress=not args.quiet)
    print(f"EAGLE-3 head written to {args.out}; use it with "
          f"speculative_config={{'method': 'eagle3', 'model': {args.out!r}, 'num_speculative_tokens': 3}}")
    return 0
