"""Stock ``generate``'s logits processors and stopping criteria, run row by row inside the engine.

For each input row the wrapped ``generate`` asks transformers' own ``_get_logits_processor`` for the list stock
``generate`` would build (``sequence_bias``, ``repetition_penalty``, ``no_repeat_ngram_size``, ``bad_words_ids``,
``min_length`` / ``min_new_tokens``, ``prefix_allowed_tokens_fn``, ``suppress_tokens``, ...; the user's
``logits_processor`` merged in as stock merges it), minus the sampling warpers, which the engine applies after
it. The row's processors and the user's ``stopping_criteria`` see the row as stock ``generate`` sees it: its
padded input row followed by what it generated (:class:`StockRowView`), so processors that look at pad tokens
or at ``input_ids.shape[-1]`` give stock's answer. What cannot run row by row falls back to stock
(:func:`fallback_reasons`).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation import logits_process as lp
from transformers.generation import stopping_criteria as sc

# Generation-config fields whose processors run per row inside the engine (stock builds them per batch).
IN_ENGINE_FIELDS = {
    "sequence_bias", "bad_words_ids", "no_repeat_ngram_size", "suppress_tokens", "begin_suppress_tokens",
    "forced_eos_token_id", "exponential_decay_length_penalty",
}
# Processors that need the batch (row pairs, codebooks, encoder ids, a second model) or run their own state
# across rows: a user who passes one gets stock generate.
_BATCH_PROCESSORS = (
    lp.ClassifierFreeGuidanceLogitsProcessor, lp.UnbatchedClassifierFreeGuidanceLogitsProcessor,
    lp.AlternatingCodebooksLogitsProcessor, lp.WhisperTimeStampLogitsProcessor, lp.WhisperNoSpeechDetection,
    lp.BarkEosPrioritizerLogitsProcessor, lp.EncoderRepetitionPenaltyLogitsProcessor,
    lp.EncoderNoRepeatNGramLogitsProcessor, lp.WatermarkLogitsProcessor, lp.SynthIDTextWatermarkLogitsProcessor,
    lp.PrefixConstrainedLogitsProcessor,  # its batch_id is the row's place in the batch: pass prefix_allowed_tokens_fn
    lp.DiaClassifierFreeGuidanceLogitsProcessor, lp.DiaEOSChannelFilterLogitsProcessor,
    lp.DiaEOSDelayPatternLogitsProcessor,
)
# Stock's own warpers: with do_sample a user's one replaces stock's at the warpers' place, after our processors.
_WARPERS = (
    lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper, lp.TopHLogitsWarper, lp.MinPLogitsWarper,
    lp.TypicalLogitsWarper, lp.EpsilonLogitsWarper, lp.EtaLogitsWarper,
)
# Criteria that replace one of stock's own (EOS, stop strings): the engine keeps its own stop rules.
_ENGINE_CRITERIA = (sc.EosTokenCriteria, sc.StopStringCriteria, sc.ConfidenceCriteria)


def _items(value) -> list:
    return [] if value is None else list(value)


def uses_hooks(gen_cfg: GenerationConfig, logits_processor, stopping_criteria, prefix_allowed_tokens_fn) -> bool:
    """Whether this call needs per-row processors or criteria in the engine."""
    return bool(
        _items(logits_processor) or _items(stopping_criteria) or prefix_allowed_tokens_fn is not None
        or any(_field_set(gen_cfg, name) for name in IN_ENGINE_FIELDS)
    )


def _field_set(gen_cfg: GenerationConfig, name: str) -> bool:
    """Whether stock would build this field's processor (its own test: not None; an n-gram size above 0)."""
    value = getattr(gen_cfg, name, None)
    return value is not None and (name != "no_repeat_ngram_size" or value > 0)


def fallback_reasons(
    gen_cfg: GenerationConfig, logits_processor, stopping_criteria, prefix_allowed_tokens_fn
) -> list[str]:
    """What of these cannot run row by row in the engine (each reason names it); empty: all of it can."""
    reasons = []
    given = [name for name, value in (("logits_processor", _items(logits_processor)),
                                      ("stopping_criteria", _items(stopping_criteria)),
                                      ("prefix_allowed_tokens_fn", prefix_allowed_tokens_fn))
             if value is not None and value != []]
    given += sorted(name for name in IN_ENGINE_FIELDS if _field_set(gen_cfg, name))
    if (gen_cfg.num_beams or 1) > 1:
        return [f"{name} with beam search" for name in given]
    for proc in _items(logits_processor):
        name = type(proc).__name__
        if isinstance(proc, _BATCH_PROCESSORS):
            reasons.append(f"logits_processor {name} (needs the whole batch)")
        elif isinstance(proc, _WARPERS) and gen_cfg.do_sample:
            reasons.append(f"logits_processor {name} (a sampling warper) with do_sample")
        elif isinstance(proc, lp.RepetitionPenaltyLogitsProcessor) and torch.is_tensor(proc.prompt_ignore_length):
            reasons.append(f"logits_processor {name} with a per-row prompt_ignore_length")
        elif not callable(proc):
            reasons.append(f"logits_processor entry {proc!r} (not callable)")
    for criterion in _items(stopping_criteria):
        name = type(criterion).__name__
        if isinstance(criterion, _ENGINE_CRITERIA):
            reasons.append(f"stopping_criteria {name}")
        elif not callable(criterion):
            reasons.append(f"stopping_criteria entry {criterion!r} (not callable)")
    return reasons


def max_length_override(stopping_criteria) -> int | None:
    """A user's ``MaxLengthCriteria`` replaces stock's own (the smallest ``max_length`` wins), or None."""
    lengths = [c.max_length for c in _items(stopping_criteria) if isinstance(c, sc.MaxLengthCriteria)]
    return min(lengths) if lengths else None


class StockRowView:
    """The row as stock ``generate`` sees it: ``[1, width + generated]``, its padded input row, then the tokens
    the engine generated for it (the engine's own ``input_ids`` hold the unpadded prompt)."""

    def __init__(self, row: torch.Tensor, prompt_len: int) -> None:
        self.row = row[None]  # [1, width]
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        new = input_ids[:, self.prompt_len :].to(self.row.device)
        return torch.cat([self.row, new], dim=1) if new.shape[1] else self.row


class RowProcessors:
    """One row's stock processor list, as one engine logits processor."""

    def __init__(self, view: StockRowView, processors: lp.LogitsProcessorList) -> None:
        self.view = view
        self.processors = processors
        self.last: torch.Tensor | None = None  # the latest processed row (stock's scores, before any warper)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = self.view(input_ids)
        self.last = self.processors(ids, scores.to(ids.device))
        return self.last.to(scores.device)

    def __repr__(self) -> str:
        return f"RowProcessors({[type(p).__name__ for p in self.processors]})"


class BatchStop:
    """Stock's rule when no stopping criterion knows an EOS token: a row whose criteria fired is finished but
    keeps generating real tokens (no pad) until every row has fired; then all stop at the longest row's length.

    Rows report here instead of stopping; each stops once ``target`` is known and reached, and a row that ran
    past it in the engine (continuous batching lets rows drift) is cut by :meth:`cut`.
    """

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.fired: dict[int, int] = {}  # id(RowCriteria) -> tokens generated when it first fired
        self.target: int | None = None

    def report(self, key: int, generated: int, fired: bool) -> bool:
        if fired and key not in self.fired:
            self.fired[key] = generated
            if len(self.fired) == self.num_rows:
                self.target = max(self.fired.values())
        return self.target is not None and generated >= self.target

    def cut(self, engine, rows) -> None:
        """Abort the rows that already hold ``target`` tokens (their outputs are cut to it when assembled)."""
        if self.target is None:
            return
        for row in rows:
            if not row.finished and row.latest is not None and len(row.latest.outputs[0].token_ids) >= self.target:
                engine.abort(row.request_id)


class RowCriteria:
    """One row's user stopping criteria, as one engine stopping criterion.

    Stock passes them its ``scores`` variable: None without ``output_scores``, else the tuple of every step's
    processed scores. So do we, with this row's ``[1, V]`` rows (processed by the row's processor list; the
    warpers of a sampled call are not in them). With ``batch_stop`` (no EOS criterion) a fired row goes on
    until every row has fired.
    """

    def __init__(
        self, view: StockRowView, criteria: list, processors: RowProcessors | None, output_scores: bool,
        batch_stop: BatchStop | None,
    ) -> None:
        self.view = view
        self.criteria = sc.StoppingCriteriaList(criteria)
        self.processors = processors
        self.history: list[torch.Tensor] | None = [] if output_scores else None
        self.batch_stop = batch_stop

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor | bool:
        ids = self.view(input_ids)
        if self.history is not None:
            latest = self.processors.last if self.processors is not None else scores
            self.history.append(latest.to(ids.device))
        fired = self.criteria(ids, None if self.history is None else tuple(self.history))
        if self.batch_stop is None:
            return fired
        generated = ids.shape[1] - self.view.row.shape[1]
        return self.batch_stop.report(id(self), generated, bool(fired.any()))


def _with_batch_id(fn, batch_id: int, _row: int, sent: torch.Tensor):
    return fn(batch_id, sent)


def stock_row_config(
    model, gen_cfg: GenerationConfig, input_ids: torch.Tensor, max_length: int, sample: bool
) -> GenerationConfig:
    """The generation config stock ``generate`` builds its processors from, for one row and one sample.

    ``sample``: keep ``do_sample`` (stock then appends its warpers: temperature, top-k, top-p, min-p, ...);
    False leaves them out, for the engine, which applies its own after the processors.
    """
    cfg = copy.deepcopy(gen_cfg)
    cfg.do_sample = bool(sample and gen_cfg.do_sample)
    cfg.num_beams, cfg.num_return_sequences = 1, 1
    # what stock's _prepare_generated_length makes of the lengths (forced_eos_token_id reads max_length)
    cfg.max_length = max_length
    if cfg.min_new_tokens is not None:
        cfg.min_length = cfg.min_new_tokens + input_ids.shape[1]
    model._prepare_special_tokens(cfg, True, device=input_ids.device)
    return cfg


def stock_row_processors(
    model, cfg: GenerationConfig, input_ids: torch.Tensor, mask: torch.Tensor, b: int, logits_processor=None,
    prefix_allowed_tokens_fn=None,
) -> lp.LogitsProcessorList:
    """Stock's processor list for input row ``b`` of ``input_ids [B, width]`` (``mask``: ``[B, width]`` bool),
    built by transformers' own ``_get_logits_processor``; ``prefix_allowed_tokens_fn`` gets ``b`` as batch id."""
    fn = prefix_allowed_tokens_fn
    return model._get_logits_processor(
        generation_config=cfg,
        input_ids_seq_length=input_ids.shape[1],
        encoder_input_ids=input_ids[b : b + 1],
        prefix_allowed_tokens_fn=None if fn is None else functools.partial(_with_batch_id, fn, b),
        logits_processor=lp.LogitsProcessorList(_items(logits_processor)),
        device=input_ids.device,
        model_kwargs={"attention_mask": mask[b : b + 1].long()},
    )


@dataclass
class RowHooks:
    """Builds each input row's engine processors and criteria for one wrapped ``generate`` call."""

    model: object
    gen_cfg: GenerationConfig
    input_ids: torch.Tensor  # [B, width], padded as given
    mask: torch.Tensor  # [B, width] bool
    max_length: int  # stock's generation_config.max_length once prepared: padded width + max new tokens
    logits_processor: object = None
    stopping_criteria: object = None
    prefix_allowed_tokens_fn: object = None

    def __post_init__(self) -> None:
        self.row_cfg = stock_row_config(self.model, self.gen_cfg, self.input_ids, self.max_length, sample=False)
        cfg = self.row_cfg
        self.criteria = [c for c in _items(self.stopping_criteria) if not isinstance(c, sc.MaxLengthCriteria)]
        # stock pads a finished row only when some criterion knows an EOS token (its has_eos_stopping_criteria)
        knows_eos = cfg._eos_token_tensor is not None or any(hasattr(c, "eos_token_id") for c in self.criteria)
        rows = self.input_ids.shape[0] * (self.gen_cfg.num_return_sequences or 1)
        self.batch_stop = BatchStop(rows) if self.criteria and not knows_eos else None

    def for_row(self, b: int) -> tuple[list, list]:
        """``(logits_processors, stopping_criteria)`` for ``SamplingParams`` of input row ``b``."""
        row = self.input_ids[b]
        view = StockRowView(row, int(self.mask[b].sum()))
        processors = stock_row_processors(self.model, self.row_cfg, self.input_ids, self.mask, b,
                                          self.logits_processor, self.prefix_allowed_tokens_fn)
        procs = [RowProcessors(view, processors)] if len(processors) else []
        crits = []
        if self.criteria:
            crits.append(RowCriteria(view, self.criteria, procs[0] if procs else None,
                                     bool(self.gen_cfg.output_scores and self.gen_cfg.return_dict_in_generate),
                                     self.batch_stop))
        return procs, crits
