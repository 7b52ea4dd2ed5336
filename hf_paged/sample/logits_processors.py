"""Per-request Python hooks in the batched sampler: HF-style logits processors and stopping criteria.

A request's ``SamplingParams.logits_processors`` run on its own logits row, with its own ``input_ids``
(prompt + generated so far, ``[1, L]``), between the engine's penalties and its temperature / top-k / top-p /
min-p (where ``GenerationMixin._get_logits_processor`` puts custom processors, before the warpers). Its
``stopping_criteria`` run after each token it gets. Rows without hooks cost nothing: a batch of plain greedy
rows never reaches :func:`hooked_rows` (the sampler's one-pass argmax path), the processors run only on the
rows that have them, and the model runner looks at a row's criteria inside the loop it already runs to emit
the row's token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hf_paged.sample.sampling import SeqState


def hooked_rows(states: Sequence[SeqState]) -> list[int]:
    """Rows whose request has logits processors."""
    return [i for i, s in enumerate(states) if s.params.logits_processors]


def row_input_ids(state: SeqState, device: torch.device, extra: Sequence[int] = ()) -> torch.Tensor:
    """``LongTensor [1, L]``: the sequence's prompt, its generated tokens, then ``extra``."""
    ids = state.prompt_token_ids + state.output_token_ids + list(extra)
    return torch.tensor([ids], dtype=torch.long, device=device)


def apply_logits_processors(logits: torch.Tensor, states: Sequence[SeqState], rows: Sequence[int]) -> None:
    """Run each row's processors on ``logits [N, V]`` (fp32, the sampler's own copy), in place, in order.

    Raises TypeError / ValueError naming the processor when one returns anything but a ``[1, V]`` tensor
    (the model runner then fails that request alone).
    """
    for i in rows:
        state = states[i]
        ids = row_input_ids(state, logits.device)
        row = scores = logits[i : i + 1]
        for proc in state.params.logits_processors:
            out = proc(ids, scores)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"logits processor {_name(proc)} returned {type(out).__name__}, expected a tensor "
                                f"of shape {tuple(scores.shape)}")
            if out.shape != scores.shape:
                raise ValueError(f"logits processor {_name(proc)} returned shape {tuple(out.shape)}, expected "
                                 f"{tuple(scores.shape)}")
            scores = out
        if scores is not row:
            logits[i] = scores[0].to(logits.dtype)


def criteria_stop(state: SeqState, token: int, scores: torch.Tensor) -> bool:
    """Whether any of the sequence's stopping criteria ends it after ``token`` (``scores``: ``[1, V]``)."""
    ids = row_input_ids(state, scores.device, (token,))
    for criterion in state.params.stopping_criteria:
        verdict = criterion(ids, scores)
        if isinstance(verdict, torch.Tensor):
            if verdict.numel() != 1:
                raise ValueError(f"stopping criterion {_name(criterion)} returned shape {tuple(verdict.shape)}, "
                                 "expected one value for the one sequence")
            verdict = verdict.item()
        if verdict is None or isinstance(verdict, (str, bytes, list, tuple, dict)):
            raise TypeError(f"stopping criterion {_name(criterion)} returned {verdict!r}, expected a bool tensor")
        if verdict:
            return True
    return False


def _name(obj: object) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__
