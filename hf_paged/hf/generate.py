"""An HF-compatible ``generate`` that runs every row of the batch through the paged engine.

It accepts what stock ``GenerationMixin.generate`` accepts for decoder-only LMs and returns the stock layout
(prompt + generated, ``pad_token_id`` after EOS). What the engine cannot honour falls back to stock
``generate`` (with a :class:`~hf_paged.PagedCache` for beam search) after a one-time warning, never a
silently different result.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

from hf_paged.hf.peft_adapters import adapters_of
from hf_paged.hf.cache import CACHE_KWARG, PagedCache
from hf_paged.engine.engine_setup import token_id_list
import hf_paged.hf.generate_processors as hooks
from hf_paged.hf.generate_beam import beam_generate
from hf_paged.hf.generate_output import FinishedRowScores, assemble
from hf_paged.outputs import RequestOutput
from hf_paged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Generation-config fields the engine honours; any other field away from its default means fallback.
SUPPORTED_FIELDS = {
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "min_p", "repetition_penalty", "num_return_sequences", "eos_token_id", "pad_token_id", "bos_token_id",
    "stop_strings", "return_dict_in_generate", "output_scores", "use_cache", "num_beams", "early_stopping",
    "length_penalty", "cache_implementation", "cache_config", "decoder_start_token_id", "generation_kwargs",
    "compile_config", "disable_compile", "_from_model_config", "transformers_version", "_commit_hash",
    "_original_object_hash", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "is_assistant",
    "prompt_lookup_num_tokens", "max_matching_ngram_size",
}
SUPPORTED_MODEL_KWARGS = {"attention_mask", "tokenizer", "use_cache"}
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def paged_generate(
    self,
    inputs: torch.Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    logits_processor=None,
    stopping_criteria=None,
    prefix_allowed_tokens_fn=None,
    synced_gpus: bool | None = None,
    assistant_model=None,
    streamer=None,
    negative_prompt_ids: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    custom_generate=None,
    **kwargs,
):
    """Stock ``generate`` signature; all rows run as one continuous batch in ``self.paged``.

    Returns ``LongTensor [batch * num_return_sequences, prompt_width + new]`` or, with
    ``return_dict_in_generate``, a ``GenerateDecoderOnlyOutput`` (``scores`` when ``output_scores``); with
    ``num_beams > 1`` the search runs in the engine and returns stock beam search's outputs
    (``GenerateBeamDecoderOnlyOutput`` with ``sequences_scores`` and ``beam_indices``).
    """
    adapters = adapters_of(self)
    adapter_names = kwargs.pop("adapter_names", None) if adapters is not None else None
    stock_args = dict(
        inputs=inputs, generation_config=generation_config, logits_processor=logits_processor,
        stopping_criteria=stopping_criteria, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        synced_gpus=synced_gpus, assistant_model=assistant_model, streamer=streamer,
        negative_prompt_ids=negative_prompt_ids, negative_prompt_attention_mask=negative_prompt_attention_mask,
        custom_generate=custom_generate, **kwargs,
    )
    reasons = [name for name in _CALLABLE_ARGS if _given(stock_args.get(name))]
    gen_cfg, model_kwargs = self._prepare_generation_config(generation_config, **kwargs)
    reasons += _unsupported_fields(self, gen_cfg)
    reasons += hooks.fallback_reasons(gen_cfg, logits_processor, stopping_criteria, prefix_allowed_tokens_fn)
    input_ids = inputs if inputs is not None else model_kwargs.pop("input_ids", None)
    reasons += [f"model kwarg {k!r}" for k in model_kwargs if k not in SUPPORTED_MODEL_KWARGS]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() not in (1, 2) or input_ids.is_floating_point():
        reasons.append("inputs other than input_ids")
    elif getattr(self.config, "is_encoder_decoder", False):
        reasons.append("encoder-decoder models")
    if gen_cfg.do_sample and not (gen_cfg.temperature or 0) > 0:
        reasons.append("temperature <= 0 with do_sample")  # stock raises the proper error
    if not gen_cfg.do_sample and (gen_cfg.num_return_sequences or 1) > 1 and (gen_cfg.num_beams or 1) == 1:
        reasons.append("num_return_sequences > 1 without sampling")  # stock raises the proper error
    if (gen_cfg.num_beams or 1) > 1 and streamer is not None:
        reasons.append("streamer with beam search")  # stock raises the proper error
    if (gen_cfg.num_beams or 1) > 1 and (assistant_model is not None or gen_cfg.prompt_lookup_num_tokens):
        reasons.append("assisted generation with beam search")  # stock raises the proper error
    loras = None
    if adapters is not None and not reasons:
        loras = adapters.row_requests(adapter_names, 1 if input_ids.dim() == 1 else input_ids.shape[0])
        if (gen_cfg.num_beams or 1) > 1 and len(set(loras)) > 1:  # a search runs with one adapter (or none)
            reasons.append("beam search with different LoRA adapters per row")
    if reasons:
        if adapter_names is not None:
            stock_args["adapter_names"] = adapter_names
        return _fallback(self, reasons, stock_args, gen_cfg)

    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    width = input_ids.shape[1]
    max_new = gen_cfg.max_new_tokens if gen_cfg.max_new_tokens is not None else gen_cfg.max_length - width
    row_hooks = None
    if hooks.uses_hooks(gen_cfg, logits_processor, stopping_criteria, prefix_allowed_tokens_fn):
        mask = _attention_mask(gen_cfg, model_kwargs, input_ids)
        row_hooks = hooks.RowHooks(self, gen_cfg, input_ids, mask, width + max_new, logits_processor,
                                   stopping_criteria, prefix_allowed_tokens_fn)
        if hooks.max_length_override(stopping_criteria) is not None:  # a user's MaxLengthCriteria replaces stock's
            max_new = hooks.max_length_override(stopping_criteria) - width
    if max_new <= 0:
        return _fallback(self, [f"no room for new tokens (max_new_tokens={max_new})"], stock_args, gen_cfg)
    if (gen_cfg.num_beams or 1) > 1:
        return beam_generate(self.paged, gen_cfg, _prompts(gen_cfg, model_kwargs, input_ids), input_ids, max_new,
                             _min_new(gen_cfg, width), loras[0] if loras else None)
    engine = self.paged
    speculative = _speculative_config(gen_cfg, assistant_model)
    rows = _add_rows(engine, gen_cfg, model_kwargs, input_ids, max_new, speculative, row_hooks, loras)
    batch_stop = row_hooks.batch_stop if row_hooks is not None else None
    lockstep = _LockstepStreamer(streamer, rows, _pad_id(gen_cfg), batch_stop) if streamer else None
    if streamer is not None:
        streamer.put(input_ids.cpu())
    try:
        while not all(r.finished for r in rows):
            progressed = False
            for row in rows:
                progressed |= row.read(engine)
            if batch_stop is not None:
                batch_stop.cut(engine, rows)
            if lockstep is not None:
                lockstep.flush()
            if not progressed and not all(r.finished for r in rows):
                engine.step()
    finally:
        for row in rows:
            if not row.finished:
                engine.abort(row.request_id)
    failed = [(row.source, c.error) for row in rows for c in row.latest.outputs if c.finish_reason == "error"]
    if failed:  # stock would have raised; a row cut short must not pass for an answer
        raise RuntimeError(f"hf_paged: generation failed for input row {failed[0][0]}: {failed[0][1]}")
    if lockstep is not None:
        lockstep.flush(final=True)
        streamer.end()
    finished_scores = None
    if gen_cfg.return_dict_in_generate and gen_cfg.output_scores:
        finished_scores = FinishedRowScores(self, gen_cfg, input_ids, _attention_mask(gen_cfg, model_kwargs, input_ids),
                                            width + max_new, logits_processor, prefix_allowed_tokens_fn)
    return assemble(gen_cfg, input_ids, rows, _pad_id(gen_cfg), batch_stop.target if batch_stop is not None else None,
                    finished_scores)


def _given(value) -> bool:
    if value is None or value is False:
        return False
    return not (isinstance(value, (list, tuple)) and len(value) == 0)


# (logits_processor, stopping_criteria and prefix_allowed_tokens_fn run per row: see generate_processors)
_CALLABLE_ARGS = {"synced_gpus", "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate"}


def _unsupported_fields(model, gen_cfg: GenerationConfig) -> list[str]:
    defaults = {**GenerationConfig().to_dict(), **model.generation_config._get_default_generation_params()}
    out = []
    for key, value in gen_cfg.to_dict().items():
        # a falsy value (None, False, 0, empty) switches the corresponding processor off
        if key in SUPPORTED_FIELDS or key in hooks.IN_ENGINE_FIELDS or not value or value == defaults.get(key):
            continue
        out.append(key)
    if (gen_cfg.num_beams or 1) > 1:
        if gen_cfg.do_sample:
            out.append("num_beams with do_sample (beam sampling)")
        if gen_cfg.stop_strings:
            out.append("num_beams with stop_strings")
        if (gen_cfg.num_return_sequences or 1) > gen_cfg.num_beams:
            out.append("num_return_sequences > num_beams")  # stock raises the proper error
        if gen_cfg.early_stopping not in (True, False, "never"):
            out.append(f"early_stopping={gen_cfg.early_stopping!r}")
    return out


def _fallback(model, reasons: list[str], stock_args: dict, gen_cfg: GenerationConfig):
    key = ",".join(sorted(reasons))
    beams = (gen_cfg.num_beams or 1) > 1
    given = stock_args.get("cache", stock_args.get("past_key_values"))
    use_cache = beams and given is None and gen_cfg.use_cache is not False
    _warn_once(
        key,
        f"hf_paged: {', '.join(reasons)} not supported by the paged engine; running stock generate"
        + (" with a PagedCache" if use_cache else "") + " instead.",
    )
    if adapters_of(model) is not None:  # a PEFT model: its own generate (stock, with its adapters)
        return type(model).generate(model, **stock_args)
    if use_cache:
        for name in ("cache", "past_key_values"):
            stock_args.pop(name, None)
        stock_args[CACHE_KWARG] = PagedCache(model)
    return GenerationMixin.generate(model, **stock_args)


def _pad_id(gen_cfg: GenerationConfig) -> int:
    if gen_cfg.pad_token_id is not None:
        return int(gen_cfg.pad_token_id)
    eos = token_id_list(gen_cfg.eos_token_id)
    return eos[0] if eos else 0


def _attention_mask(gen_cfg: GenerationConfig, model_kwargs: dict, input_ids: torch.Tensor) -> torch.Tensor:
    mask = model_kwargs.get("attention_mask")
    if mask is not None:
        if mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(mask.shape)} does not match input_ids {tuple(input_ids.shape)}")
        return mask.bool()
    # Stock's inference: pad tokens are masked when pad is set, present, and not also the EOS token.
    pad, eos = gen_cfg.pad_token_id, token_id_list(gen_cfg.eos_token_id)
    if pad is not None and bool((input_ids == pad).any()) and pad not in eos:
        return input_ids != pad
    return torch.ones_like(input_ids, dtype=torch.bool)


def _prompts(gen_cfg: GenerationConfig, model_kwargs: dict, input_ids: torch.Tensor) -> list[list[int]]:
    """Each row's prompt without its padding."""
    mask = _attention_mask(gen_cfg, model_kwargs, input_ids).cpu()
    ids = input_ids.cpu()
    return [ids[b][mask[b]].tolist() for b in range(ids.shape[0])]


def _min_new(gen_cfg: GenerationConfig, width: int) -> int:
    return max(0, (gen_cfg.min_length or 0) - width, gen_cfg.min_new_tokens or 0)


@dataclass
class _Row:
    """One request of the call (``num_return_sequences`` output rows) and its latest output."""

    request_id: str
    source: int  # input row it came from
    scores: dict[int, list] | None
    latest: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self.latest is not None and self.latest.finished

    def read(self, engine) -> bool:
        outs = engine.poll(self.request_id)
        if outs:
            self.latest = outs[-1]
        return bool(outs)


def _speculative_config(gen_cfg: GenerationConfig, assistant_model) -> dict | None:
    """HF's assisted-generation kwargs as the engine's per-request speculative decoding."""
    if assistant_model is not None:
        k = min(int(gen_cfg.num_assistant_tokens or 20), 8)  # the engine lowers k further on rejections
        return {"method": "draft_model", "model": assistant_model, "num_speculative_tokens": k}
    if gen_cfg.prompt_lookup_num_tokens:
        return {"method": "ngram", "num_speculative_tokens": min(int(gen_cfg.prompt_lookup_num_tokens), 15),
                "prompt_lookup_min": 1, "prompt_lookup_max": int(gen_cfg.max_matching_ngram_size or 2)}
    return None


def _add_rows(
    engine, gen_cfg: GenerationConfig, model_kwargs: dict, input_ids: torch.Tensor, max_new: int, speculative=None,
    row_hooks: hooks.RowHooks | None = None, loras: list | None = None,
) -> list[_Row]:
    prompts = _prompts(gen_cfg, model_kwargs, input_ids)
    min_new = _min_new(gen_cfg, input_ids.shape[1])
    eos = token_id_list(gen_cfg.eos_token_id)
    stop = gen_cfg.stop_strings
    tokenizer = model_kwargs.get("tokenizer")
    if stop is not None and tokenizer is None and engine.tokenizer is None:
        raise ValueError(f"stop_strings={stop!r} need a tokenizer: pass tokenizer= to generate (as with stock generate)")
    n_return = gen_cfg.num_return_sequences or 1
    sampled = bool(gen_cfg.do_sample)
    # Seeds drawn from torch's global generator: torch.manual_seed(...) makes a sampled call reproducible,
    # as it does for stock generate. Sample k of row b uses seed base + b * n + k.
    base_seed = int(torch.randint(0, 2**62, ()).item()) if sampled else None
    rows: list[_Row] = []
    try:
        for b, prompt in enumerate(prompts):
            params = SamplingParams(
                max_tokens=max_new,
                temperature=float(gen_cfg.temperature) if sampled else 0.0,
                top_k=int(gen_cfg.top_k or 0) if sampled else 0,
                top_p=float(gen_cfg.top_p if gen_cfg.top_p is not None else 1.0) if sampled else 1.0,
                min_p=float(gen_cfg.min_p or 0.0) if sampled else 0.0,
                seed=(base_seed + b * n_return) % 2**62 if sampled else None,
                stop_token_ids=eos,
                ignore_eos=True,  # the engine's own EOS set is replaced by this call's eos_token_id
                min_tokens=min(min_new, max_new) if eos else 0,
                repetition_penalty=float(gen_cfg.repetition_penalty or 1.0),
                stop=[stop] if isinstance(stop, str) else stop,
                n=n_return,
            )
            samples = [params]
            if row_hooks is not None:
                # stock's processor list (penalty and min length included) runs per row; each sample is its own
                # request with its own processor and criteria objects (seed + k, as a forked sample's)
                samples = []
                for k in range(n_return):
                    procs, crits = row_hooks.for_row(b)
                    samples.append(params.clone(
                        n=1, min_tokens=0, repetition_penalty=1.0, logits_processors=procs, stopping_criteria=crits,
                        seed=None if params.seed is None else (params.seed + k) % 2**62))
            for sample in samples:
                rid = engine.add_request(
                    prompt, sample, tokenizer=tokenizer, return_scores=bool(gen_cfg.output_scores),
                    queue_outputs=True, speculative_config=speculative,
                    stop_at_context=True,  # stock max_new_tokens: cut at the context
                    lora_request=None if loras is None else loras[b],
                )
                rows.append(_Row(rid, b, engine.scores_of(rid)))
    except BaseException:
        for row in rows:
            engine.abort(row.request_id)
        raise
    return rows


class _LockstepStreamer:
    """Feeds an HF streamer one ``[batch]`` tensor per step, as stock generate does.

    Rows of the engine can drift apart (chunked prefill, preemption), so column k goes out once every row
    has produced its k-th token or finished (finished rows contribute the pad token).
    """

    def __init__(self, streamer, rows: list[_Row], pad: int, batch_stop: hooks.BatchStop | None = None) -> None:
        self.streamer = streamer
        self.rows = rows
        self.pad = pad
        self.sent = 0
        self.batch_stop = batch_stop  # rows may run past its target: those tokens are cut, never streamed

    def flush(self, final: bool = False) -> None:
        while True:
            k = self.sent
            if self.batch_stop is not None and self.batch_stop.target is not None and k >= self.batch_stop.target:
                return
            if any(row.latest is None for row in self.rows):
                return
            completions = [c for row in self.rows for c in row.latest.outputs]
            if all(len(c.token_ids) <= k for c in completions):
                return  # everyone finished before step k
            column = []
            for c in completions:
                if len(c.token_ids) > k:
                    column.append(c.token_ids[k])
                elif c.finished:
                    column.append(self.pad)
                else:
                    return
            self.streamer.put(torch.tensor(column))
            self.sent += 1
