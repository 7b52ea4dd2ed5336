"""The wrapped ``generate``'s return value in stock's layout, and the scores of rows that finished early.

Stock ``generate`` keeps running a row after its EOS: it feeds the row the pad token, runs the forward, applies
its logits processors and records the result in ``scores`` (only the chosen token is replaced by the pad). The
engine stops a finished row instead. When ``output_scores`` is asked, :class:`FinishedRowScores` computes what
stock would have recorded for those steps, after the engine is done, with one plain forward of the model per
such row (the prompt, the row's tokens, then the pads; no padding, so no mask) and stock's own processor list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.utils import GenerateDecoderOnlyOutput

import hf_paged.hf.generate_processors as hooks


@dataclass
class FinishedRowScores:
    """Stock's ``scores`` for the steps after a row finished: the model's logits after the row's pads,
    processed by the list stock builds for the row (its warpers included when sampling)."""

    model: object
    gen_cfg: GenerationConfig
    input_ids: torch.Tensor  # [B, width], padded as given
    mask: torch.Tensor  # [B, width] bool
    max_length: int  # padded width + max new tokens, as stock prepares it
    logits_processor: object = None
    prefix_allowed_tokens_fn: object = None
    _processors: dict[int, LogitsProcessorList] = field(default_factory=dict, repr=False)

    def complete(self, scores: list[torch.Tensor], source: int, sequence: torch.Tensor) -> list[torch.Tensor]:
        """``scores`` (the row's ``[V]`` rows the engine kept) extended to one per new column of ``sequence``
        (``[width + new]``, the row's stock output: pads after its last token)."""
        width = self.input_ids.shape[1]
        new = sequence.shape[0] - width
        done = len(scores)
        if done >= new:
            return scores
        prompt = self.input_ids[source][self.mask[source]]
        # the forward of stock's step k (k >= done) ends at the row's column width + k - 1
        tokens = torch.cat([prompt, sequence[width : width + new - 1].to(prompt.device)])
        logits = self._last_logits(tokens, new - done)
        processors = self._row_processors(source)
        extra = []
        for j, k in enumerate(range(done, new)):
            row = logits[j : j + 1]
            if len(processors):
                row = processors(sequence[None, : width + k].to(row.device), row)
            extra.append(row[0])
        return scores + extra

    def _last_logits(self, tokens: torch.Tensor, keep: int) -> torch.Tensor:
        """fp32 ``[keep, V]``: the logits at the last ``keep`` positions of a plain forward over ``tokens``."""
        kwargs = {"logits_to_keep": keep} if self.model._supports_logits_to_keep() else {}
        with torch.no_grad():
            out = self.model(input_ids=tokens[None], use_cache=False, **kwargs)
        return out.logits[0, -keep:].float()

    def _row_processors(self, source: int) -> LogitsProcessorList:
        if source not in self._processors:
            cfg = hooks.stock_row_config(self.model, self.gen_cfg, self.input_ids, self.max_length, sample=True)
            self._processors[source] = hooks.stock_row_processors(
                self.model, cfg, self.input_ids, self.mask, source, self.logits_processor, self.prefix_allowed_tokens_fn)
        return self._processors[source]


def assemble(
    gen_cfg: GenerationConfig, input_ids: torch.Tensor, rows: list, pad: int, limit: int | None = None,
    finished_scores: FinishedRowScores | None = None,
):
    """The stock output of the wrapped ``generate``.

    ``rows``: its ``_Row``s (a request, its input row ``source``, its latest output and kept scores).
    ``limit``: every row's tokens cut to this many (a batch-wide stop, see ``BatchStop``). ``finished_scores``:
    fills the ``scores`` of rows that finished early (needed when ``output_scores`` is asked).
    """
    completions = [(row, c) for row in rows for c in row.latest.outputs]
    outs = [c.token_ids[:limit] for _, c in completions]
    new = max(len(o) for o in outs)
    width = input_ids.shape[1]
    sequences = torch.full((len(outs), width + new), pad, dtype=input_ids.dtype)
    sources = torch.tensor([row.source for row, _ in completions])
    sequences[:, :width] = input_ids.cpu().index_select(0, sources)
    for i, o in enumerate(outs):
        sequences[i, width : width + len(o)] = torch.tensor(o, dtype=input_ids.dtype)
    if not gen_cfg.return_dict_in_generate:
        return sequences.to(input_ids.device)
    scores = None
    if gen_cfg.output_scores:
        assert finished_scores is not None, "output_scores needs the finished rows' scores"
        per_row = [finished_scores.complete(row.scores.get(c.index, [])[:new], row.source, sequences[i])
                   for i, (row, c) in enumerate(completions)]
        scores = tuple(torch.stack([s[k].cpu() for s in per_row]).to(input_ids.device) for k in range(new))
    return GenerateDecoderOnlyOutput(sequences=sequences.to(input_ids.device), scores=scores)
