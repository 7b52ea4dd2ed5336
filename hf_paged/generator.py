"""``PagedGenerator``: request intake, the step loop, batch generation and streaming."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator, Sequence

import torch

from hf_paged import attention
from hf_paged.cache import KVPool, decide_num_blocks, probe_kv_layout
from hf_paged.config import EngineConfig
from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.core.scheduler import Scheduler
from hf_paged.kernels import packed_linear, resolve_backend
from hf_paged.kernels.packed_linear import PackedLinears
from hf_paged.outputs import IncrementalDetokenizer, RequestOutput, StopStringChecker
from hf_paged.runner import ModelRunner
from hf_paged.sampling import Sampler
from hf_paged.sampling_params import SamplingParams
from hf_paged.sequence import Request, RequestStatus

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int] | torch.Tensor


class PagedGenerator:
    """A continuous-batching engine over a HuggingFace causal LM, with a paged KV cache.

    Args:
        model: A ``transformers`` causal LM whose class supports the attention interface. It is switched
            to the "hf_paged" attention implementation; a plain forward still behaves as before.
        tokenizer: Optional; needed for text prompts and for ``RequestOutput.text``.
        **config: Fields of :class:`~hf_paged.config.EngineConfig` (``block_size``, ``num_blocks``,
            ``kv_cache_memory``, ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``,
            ``attention_backend``, ...). An unknown key raises TypeError.

    Example:
        >>> engine = PagedGenerator(model, tokenizer, max_num_seqs=64)
        >>> outs = engine.generate(["Hi", "Tell me a joke"], SamplingParams(max_tokens=32, temperature=0))
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, **config: object) -> None:
        self.config = EngineConfig.from_kwargs(**config)
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self._previous_attn = attention.enable(model)
        try:
            self._build_pool()
            self.backend = resolve_backend(self.config.attention_backend, self.device, self.pool.specs[0].dtype)
            self.packed = self._maybe_prepack()
        except BaseException:
            attention.disable(model, self._previous_attn)
            raise
        cfg = self.config
        self.kv_manager = KVCacheManager(self.pool.num_blocks, cfg.block_size)
        self.scheduler = Scheduler(
            self.kv_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len,
            cfg.enable_chunked_prefill,
        )
        self.sampler = Sampler(self.device, cfg.seed)
        self.runner = ModelRunner(model, self.pool, self.backend, self.sampler)
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._pending: list[RequestOutput] = []  # aborted outputs, reported by the next step()
        self._stop_checkers: dict[str, StopStringChecker] = {}
        self.num_steps = 0

    def _build_pool(self) -> None:
        model = self.model
        if model.training:
            logger.warning("model is in training mode: dropout will make generation random; call model.eval()")
        cfg = self.config
        specs = probe_kv_layout(model)
        model_max = _max_positions(model)
        chunk = attention.chunked_attention_size(model)
        if chunk is not None:  # exact only up to one attention chunk (Llama 4): cap the length there
            if cfg.max_model_len is not None and cfg.max_model_len > chunk:
                raise NotImplementedError(
                    f"max_model_len={cfg.max_model_len} exceeds the attention chunk ({chunk} tokens) of "
                    f"{type(model).__name__}; hf_paged has no chunked attention mask, so it serves at most one chunk"
                )
            model_max = min(model_max or chunk, chunk)
        want_len = cfg.max_model_len or model_max or 4096
        num_blocks = decide_num_blocks(
            specs, cfg.block_size, self.device, cfg.num_blocks, cfg.kv_cache_memory,
            cfg.kv_cache_memory_fraction, max_tokens_needed=cfg.max_num_seqs * want_len,
        )
        capacity = num_blocks * cfg.block_size
        if cfg.max_model_len is not None:
            if cfg.max_model_len > capacity:
                raise ValueError(
                    f"max_model_len={cfg.max_model_len} does not fit the KV pool ({capacity} tokens); "
                    "give more num_blocks / kv_cache_memory or a smaller max_model_len"
                )
            if model_max is not None and cfg.max_model_len > model_max:
                raise ValueError(
                    f"max_model_len={cfg.max_model_len} exceeds the model's max_position_embeddings={model_max}"
                )
            self.max_model_len = cfg.max_model_len
        else:
            self.max_model_len = min(model_max or capacity, capacity)
        self.pool = KVPool(specs, num_blocks, cfg.block_size, self.device)
        logger.info(
            "KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB, %d layers); max_model_len %d",
            num_blocks, cfg.block_size, capacity, self.pool.total_bytes / 2**20, len(specs), self.max_model_len,
        )

    def _maybe_prepack(self) -> PackedLinears | None:
        want = self.config.prepack_weights
        if want is False or self.device.type != "cpu":
            if want not in (None, False):
                raise ValueError(f"prepack_weights={want!r} is for CPU models; this one is on {self.device}")
            return None
        kind = want if isinstance(want, str) else ("any" if want else "auto")
        packed = PackedLinears(self.model, attention.engine_forward_active, kind)
        if want is not None and not packed:
            dtypes = sorted({str(p.dtype) for p in self.model.parameters()})
            tried = [k for k in packed_linear.KINDS if kind in ("any", k)]
            why = "; ".join(
                f"{k} for {d.removeprefix('torch.')}: {packed_linear.unavailable_reason(k, getattr(torch, d.removeprefix('torch.')))}"
                for k in tried for d in dtypes
            )
            raise RuntimeError(f"prepack_weights={want!r}: no nn.Linear weight of this model can be packed here ({why})")
        return packed if packed else None

    # -- intake -------------------------------------------------------------------------------------
    def _token_ids(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: pass tokenizer= to the engine, or token ids")
            ids = self.tokenizer(prompt)["input_ids"]
            text: str | None = prompt
        elif isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.is_floating_point():
                raise TypeError(f"a tensor prompt must be 1-D integer token ids, got {prompt.dtype} {tuple(prompt.shape)}")
            ids, text = prompt.tolist(), None
        elif isinstance(prompt, Sequence):
            ids, text = list(prompt), None
        else:
            raise TypeError(f"prompt must be a str, a list of token ids or a 1-D tensor, got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"prompt {prompt!r} is empty (no tokens)")
        for tok in ids:
            if isinstance(tok, bool) or not isinstance(tok, int):
                raise TypeError(f"token ids must be ints, got {tok!r} ({type(tok).__name__})")
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"token id {tok} is outside the vocabulary [0, {self.vocab_size})")
        return ids, text

    def _make_request(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str | None, tokenizer=None
    ) -> Request:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        ids, text = self._token_ids(prompt)
        rid = str(next(self._ids)) if request_id is None else request_id
        if not isinstance(rid, str):
            raise TypeError(f"request_id must be a str, got {rid!r}")
        if params.stop and (tokenizer or self.tokenizer) is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer: pass tokenizer= to the engine")
        request = Request(rid, ids, params, self.eos_token_ids, self.max_model_len, prompt=text)
        self.scheduler.check_request(request)
        return request

    def _admit(self, request: Request, tokenizer=None) -> None:
        self.scheduler.add_request(request)
        if request.sampling_params.stop:
            self._stop_checkers[request.request_id] = StopStringChecker(
                tokenizer or self.tokenizer, request.sampling_params.stop, request.prompt_token_ids
            )

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue one request; returns its id. Bad input raises ValueError/TypeError and changes nothing."""
        with self._lock:
            request = self._make_request(prompt, sampling_params, request_id)
            self._admit(request)
            return request.request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is unknown or already finished."""
        with self._lock:
            request = self.scheduler.abort_request(request_id)
            if request is None:
                return False
            self._stop_checkers.pop(request_id, None)
            self._pending.append(self._output(request))
            return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the requests that got tokens, finished, or were aborted since."""
        with self._lock:
            out = self.scheduler.schedule()
            pending, self._pending = self._pending, []
            if out.is_empty:
                self.sampler.forget(out.finished_req_ids)
                if self.scheduler.has_unfinished_requests():
                    raise RuntimeError("scheduler made no progress with requests pending (a bug: please report)")
                return pending
            sampled = self.runner.execute(out)
            changed = self.scheduler.update(out, sampled)
            if self._stop_checkers:
                self._check_stop_strings(changed)
            self.num_steps += 1
            return pending + [self._output(r) for r in changed]

    def _check_stop_strings(self, changed: list[Request]) -> None:
        for request in changed:
            checker = self._stop_checkers.get(request.request_id)
            if checker is None:
                continue
            stop = checker.update(request.output_token_ids)
            if stop is not None:
                request.stop_str = stop
                if request.is_finished:  # the same token also hit max_tokens: the stop string wins
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            if request.is_finished:
                del self._stop_checkers[request.request_id]

    def _output(self, request: Request) -> RequestOutput:
        text = None
        if request.stop_str is not None and self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
            cut = text.find(request.stop_str)
            text = text[:cut] if cut >= 0 else text
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            arrival_time=request.arrival_time,
            first_token_time=request.first_token_time,
            finish_time=request.finish_time,
            prompt=request.prompt,
            _text=text,
            _tokenizer=self.tokenizer,
        )

    # -- high level ---------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt as one continuous batch; outputs come back in input order.

        Args:
            prompts: A str, a list of str, a list of token ids (one prompt), or a list of token-id lists.
            sampling_params: One SamplingParams for all prompts, or one per prompt. Default: SamplingParams().
            use_tqdm: Show a progress bar of finished requests.
        """
        prompt_list = _as_prompt_list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompt_list)} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params] * len(prompt_list)
        with self._lock:
            requests = [self._make_request(p, sp, None) for p, sp in zip(prompt_list, params_list)]
            for request in requests:
                self._admit(request)
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc="Generating", disable=not use_tqdm, unit="req")
        done = 0
        try:
            while done < len(requests):
                self.step()
                now_done = sum(r.is_finished for r in requests)
                bar.update(now_done - done)
                done = now_done
        finally:
            bar.close()
            for r in requests:
                if not r.is_finished:
                    self.abort(r.request_id)
        return [self._output(r) for r in requests]

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> Iterator[RequestOutput]:
        """Yield a request's output as it grows: each item carries only the new token ids and text.

        The loop drives the whole engine, so other queued requests progress too. Closing the iterator
        early aborts the request.
        """
        with self._lock:
            request = self._make_request(prompt, sampling_params, request_id)
            self._admit(request)
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        # Text that could still turn out to be the start of a stop string is held back until it cannot.
        hold = max((len(s) - 1 for s in request.sampling_params.stop or ()), default=0)
        sent = emitted = 0
        try:
            while True:
                if not request.is_finished:
                    self.step()
                new = request.output_token_ids[sent:]
                if not new and not request.is_finished:
                    continue
                sent += len(new)
                delta = None
                if detok is not None:
                    detok.add(new)
                    if request.is_finished:
                        detok.finish()
                        final = self._output(request).text if request.stop_str else detok.text
                        delta = final[emitted:]
                    else:
                        safe = max(emitted, len(detok.text) - hold)
                        delta, emitted = detok.text[emitted:safe], safe
                yield RequestOutput(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    token_ids=new,
                    finish_reason=request.status.finish_reason,
                    arrival_time=request.arrival_time,
                    first_token_time=request.first_token_time,
                    finish_time=request.finish_time,
                    prompt=request.prompt,
                    _text=delta,
                )
                if request.is_finished:
                    return
        finally:
            if not request.is_finished:
                self.abort(request.request_id)

    def close(self) -> None:
        """Give the model back its original attention implementation and drop the KV pool."""
        with self._lock:
            for rid in list(self.scheduler.requests):
                self.abort(rid)
            attention.disable(self.model, self._previous_attn)
            if self.packed is not None:
                self.packed.remove()
                self.packed = None
            self.pool.kv_caches.clear()


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, torch.Tensor)):
        return [prompts]
    if isinstance(prompts, Sequence):
        if not prompts:
            raise ValueError("prompts is empty")
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            return [list(prompts)]  # one prompt of token ids
        return list(prompts)
    raise TypeError(f"prompts must be a str, a list of str, or token ids, got {type(prompts).__name__}")


def _max_positions(model: torch.nn.Module) -> int | None:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _eos_token_ids(model: torch.nn.Module, tokenizer) -> frozenset[int]:
    eos = None
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is not None:
        eos = gen_cfg.eos_token_id
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
