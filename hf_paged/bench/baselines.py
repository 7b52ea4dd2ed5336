"""The HuggingFace baselines of docs/benchmarks.md, each timed from first submission to last token."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from hf_paged.bench.common import SystemResult, timed


def _generated_lengths(new_tokens: torch.Tensor, eos_ids: set[int], limits: list[int]) -> list[int]:
    """Tokens each row really produced: up to and including its first EOS, at most its own limit."""
    lengths = []
    for row, limit in zip(new_tokens.tolist(), limits):
        n = limit
        for i, tok in enumerate(row[:limit]):
            if tok in eos_ids:
                n = i + 1
                break
        lengths.append(n)
    return lengths


def hf_padded_generate(
    model, prompts: list[list[int]], max_new_tokens: list[int], pad_id: int, eos_ids: set[int] | None,
    batch_size: int | None = None, label: str = "HF generate (padded batch)",
) -> tuple[SystemResult, list[list[int]]]:
    """Stock ``generate`` on left-padded batches in arrival order; each batch runs to its longest output.

    With ``eos_ids`` None, EOS is ignored (every row runs to its own ``max_new_tokens``, which alone counts).
    """
    batch_size = batch_size or len(prompts)
    outputs: list[list[int]] = []
    total_time = 0.0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        limits = max_new_tokens[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        longest = max(limits)
        kwargs = dict(max_new_tokens=longest, do_sample=False, pad_token_id=pad_id)
        if eos_ids is None:
            kwargs.update(eos_token_id=None, min_new_tokens=longest)
        else:
            kwargs.update(eos_token_id=sorted(eos_ids))
        with torch.inference_mode():
            out, seconds = timed(model.generate, input_ids=ids.to(model.device), attention_mask=mask.to(model.device), **kwargs)
        total_time += seconds
        new = out[:, width:].cpu()
        lengths = _generated_lengths(new, eos_ids or set(), limits)
        outputs.extend(row[:n] for row, n in zip(new.tolist(), lengths))
    tokens = sum(len(o) for o in outputs)
    return SystemResult(label, tokens, total_time), outputs


def hf_generate_batch(
    model, prompts: list[list[int]], max_new_tokens: list[int], eos_ids: set[int] | None,
    label: str = "HF generate_batch (continuous batching)",
) -> tuple[SystemResult, list[list[int]]]:
    """transformers' own continuous batching (the manager behind ``generate_batch``), one request per prompt."""
    gen_cfg = GenerationConfig(
        max_new_tokens=max(max_new_tokens), do_sample=False,
        eos_token_id=sorted(eos_ids) if eos_ids else None, pad_token_id=0,
    )

    def run():
        results = {}
        with model.continuous_batching_context_manager(generation_config=gen_cfg, block=True, timeout=30) as manager:
            ids = [
                manager.add_request(p, max_new_tokens=n, eos_token_id=sorted(eos_ids) if eos_ids else None)
                for p, n in zip(prompts, max_new_tokens)
            ]
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("HF continuous batching thread stopped early")
        return [results[i].generated_tokens for i in ids]

    outputs, seconds = timed(run)
    return SystemResult(label, sum(len(o) for o in outputs), seconds), outputs
