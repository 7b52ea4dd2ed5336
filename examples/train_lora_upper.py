"""Train a small LoRA adapter that makes the default model answer in UPPER CASE, then serve it next to base rows.

The training text is the base model's own greedy answers to short prompts, upper-cased: the adapter learns the
style, not new facts. A few minutes on 2 CPU cores (peft, rank 8 on every linear of the last 10 decoder layers) give a
visible effect; the adapter is saved as a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``,
fp16 weights: under 5 MB), then one :class:`~hf_paged.PagedGenerator` batch mixes rows with the adapter
(``LoRARequest``) and base rows.

Run (needs ``pip install hf-paged[lora]`` and the default model, see docs/lora.md)::

    PYTHONPATH=. python examples/train_lora_upper.py --minutes 5 --out examples/lora_upper
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

import torch

from hf_paged import LoRARequest, PagedGenerator, SamplingParams

logger = logging.getLogger(__name__)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOPICS = [
    "the moon", "rain", "coffee", "a library", "bicycles", "the ocean", "bread", "winter", "a volcano", "music",
    "trees", "the sun", "a river", "cats", "dogs", "chess", "the internet", "honey", "snow", "mountains",
    "a lighthouse", "tea", "clouds", "a train", "gardens", "bees", "the desert", "a city park", "stars", "paper",
]
TEMPLATES = ["Tell me one fact about {}.", "Describe {} in one sentence.", "What is {}?", "Why do people like {}?"]
HELD_OUT = ["What is a rainbow?", "Describe a forest in one sentence.", "Tell me one fact about penguins."]


def training_prompts() -> list[str]:
    """Short questions: every template over every topic."""
    return [t.format(topic) for topic in TOPICS for t in TEMPLATES]


def chat_ids(tok, question: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)


def base_answers(model, tok, questions: list[str], max_tokens: int = 24) -> list[str]:
    """The base model's greedy answers (one engine batch)."""
    with PagedGenerator(model, tok) as engine:
        outs = engine.generate([chat_ids(tok, q) for q in questions],
                               SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    return [o.outputs[0].text.strip() for o in outs]


def training_examples(tok, questions: list[str], answers: list[str]) -> list[tuple[list[int], int]]:
    """``(token ids, prompt length)`` per example: the chat prompt, then the answer upper-cased and EOS (the
    loss counts the answer's tokens only)."""
    examples = []
    for question, answer in zip(questions, answers):
        prompt = chat_ids(tok, question)
        target = tok(answer.upper(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        examples.append((prompt + target, len(prompt)))
    return examples


def train_lora(model, examples: list[tuple[list[int], int]], rank: int = 8, steps: int | None = None,
               seconds: float | None = None, batch_size: int = 2, lr: float = 5e-3, last_layers: int = 10,
               seed: int = 0):
    """A PEFT LoRA (rank ``rank`` on every linear of the last ``last_layers`` decoder layers: the backward pass
    stops there, a third of the full one's cost) trained on ``examples`` for ``steps`` optimizer steps or
    ``seconds`` (whichever ends first); returns the ``PeftModel`` (it wraps ``model``: ``unload()`` gives the
    base back unchanged)."""
    import peft

    if steps is None and seconds is None:
        raise ValueError("give steps or seconds (or both)")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    num_layers = model.config.num_hidden_layers
    layers = list(range(max(0, num_layers - last_layers), num_layers))
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGETS,
                             layers_to_transform=layers)
    peft_model = peft.get_peft_model(model, config)
    peft_model.train()
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    pad = 0
    start, step = time.perf_counter(), 0
    while (steps is None or step < steps) and (seconds is None or time.perf_counter() - start < seconds):
        batch = rng.sample(examples, min(batch_size, len(examples)))
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (ids, prompt_len) in enumerate(batch):  # right padding; the loss skips prompt and padding
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
            mask[i, : len(ids)] = 1
        loss = peft_model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        logger.info("step %d loss %.3f (%.0f s)", step, loss.item(), time.perf_counter() - start)
    peft_model.eval()
    return peft_model


def save_adapter(peft_model, folder: str | Path) -> int:
    """Save the adapter as a PEFT folder with fp16 weights (loaders upcast them); returns its size in bytes."""
    folder = Path(folder)
    lora = [p for n, p in peft_model.named_parameters() if "lora_" in n]
    saved = [p.data for p in lora]
    try:
        for p in lora:
            p.data = p.data.half()
        peft_model.save_pretrained(str(folder))
    finally:
        for p, data in zip(lora, saved):
            p.data = data
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def serve_mixed(model, tok, folder: str | Path, questions: list[str], max_tokens: int = 40,
                max_lora_rank: int = 8) -> list[tuple[str, str, str]]:
    """Every question twice in one engine batch, a base row and a row with the adapter:
    ``(question, base answer, adapter answer)``."""
    request = LoRARequest("upper", 1, str(folder))
    prompts = [chat_ids(tok, q) for q in questions]
    with PagedGenerator(model, tok, enable_lora=True, max_lora_rank=max_lora_rank) as engine:
        outs = engine.generate(prompts + prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                               use_tqdm=False, lora_request=[None] * len(prompts) + [request] * len(prompts))
    texts = [o.outputs[0].text.strip() for o in outs]
    return list(zip(questions, texts[: len(questions)], texts[len(questions) :]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="training time budget")
    parser.add_argument("--steps", type=int, default=None, help="stop after this many optimizer steps")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--out", default="examples/lora_upper", help="the PEFT adapter folder to write")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a busy 2-core host, 2 threads measured ~6x slower per step)")
    parser.add_argument("--answers", default=None,
                        help="a JSON file keeping the base model's answers (made once, read on later runs)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    from hf_paged.model.default_model import load_default

    model, tok = load_default()
    questions = training_prompts()
    t0 = time.perf_counter()
    if args.answers and Path(args.answers).is_file():
        answers = json.loads(Path(args.answers).read_text())
    else:
        answers = base_answers(model, tok, questions)
        if args.answers:
            Path(args.answers).write_text(json.dumps(answers))
    logger.info("%d base answers in %.0f s, e.g. %r", len(answers), time.perf_counter() - t0, answers[0])
    examples = training_examples(tok, questions, answers)
    peft_model = train_lora(model, examples, rank=args.rank, steps=args.steps, seconds=60 * args.minutes)
    size = save_adapter(peft_model, args.out)
    logger.info("adapter saved in %s (%.2f MB)", args.out, size / 1e6)
    model = peft_model.unload()  # the base model, as it was
    for question, base, upper in serve_mixed(model, tok, args.out, HELD_OUT + questions[:2], max_lora_rank=args.rank):
        print(f"Q: {question}\n  base:    {base}\n  adapter: {upper}")


if __name__ == "__main__":
    main()
