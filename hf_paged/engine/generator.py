"""``PagedGenerator``: request intake, the step loop and batch generation (streams, queued outputs and beam
search: :mod:`hf_paged.engine.generator_clients`)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import abc

import torch

from hf_paged.model import patches as model_patches
from hf_paged.engine.beam_search import BeamSearch
from hf_paged.config import EngineConfig
from hf_paged.core.kv_cache_manager import KVCacheManager
from hf_paged.core.kv_tiers import KVTiers
from hf_paged.core.scheduler import Scheduler
from hf_paged.core.scheduler_output import SchedulerOutput
from hf_paged.engine.engine_setup import eos_token_ids, token_ids
from hf_paged.executor.executor import Executor
from hf_paged.executor.factory import make_executor
from hf_paged.executor.setup import check_speculative
from hf_paged.engine.generator_clients import GeneratorClients
from hf_paged.engine.generator_structured import StructuredIntake
from hf_paged.engine.generator_loading import from_pretrained
from hf_paged.engine.generator_lora import LoRAIntake
from hf_paged.engine.generator_weights import WeightWatch
from hf_paged.engine.output_processor import OutputProcessor, RequestState
from hf_paged.lora.request import LoRARequest
from hf_paged.outputs import EngineStats, RequestOutput
from hf_paged.sampling_params import SamplingParams
from hf_paged.core.sequence import Sequence, SequenceStatus
from hf_paged.spec_decode.config import SpeculativeConfig
from hf_paged.spec_decode.speculator import spec_key

logger = logging.getLogger(__name__)

Prompt = str | abc.Sequence[int] | torch.Tensor


class PagedGenerator(GeneratorClients, StructuredIntake, LoRAIntake, WeightWatch):
    """A continuous-batching engine over a HuggingFace causal LM, with a paged KV cache.

    Args:
        model: A ``transformers`` causal LM whose class supports the attention interface. It is switched
            to the "hf_paged" attention implementation; a plain forward still behaves as before. With
            ``tensor_parallel_size=N`` > 1 it may also be a folder path (each rank loads it; see
            :meth:`from_pretrained`), and the engine runs shards of it in N processes: the caller's model is
            left as it is and :attr:`model` is rank 0's shard.
        tokenizer: Optional; needed for text prompts, stop strings and ``RequestOutput.text``.
        **config: Fields of :class:`~hf_paged.config.EngineConfig` (``block_size``, ``num_blocks``,
            ``max_num_seqs``, ``enable_prefix_caching``, ``preemption_mode``, ...). An unknown key raises
            TypeError.

    Example:
        >>> engine = PagedGenerator(model, tokenizer, max_num_seqs=64)
        >>> outs = engine.generate(["Hi", "Tell me a joke"], SamplingParams(max_tokens=32, temperature=0))
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, **config: object) -> None:
        self.config = cfg = EngineConfig.from_kwargs(**config)
        self.tokenizer = tokenizer
        self._closed = True  # until fully built: close() then undoes nothing twice
        # the execution layer, chosen once: this process, or a tensor-parallel group (its rank 0's shard is then
        # the engine's model)
        self.executor: Executor = make_executor(model, cfg)
        self.model = model = self.executor.model
        self.device = next(model.parameters()).device
        self.max_model_len = self.executor.max_model_len
        try:
            self._build(model, tokenizer, cfg)
        except BaseException:
            self.executor.close()  # a failure halfway gives the model back at once
            raise
        self._weights_seen: int | None = None
        self._closed = False

    from_pretrained = classmethod(from_pretrained)  # an engine over a local model folder (all ranks under TP)

    def _build(self, model: torch.nn.Module, tokenizer, cfg: EngineConfig) -> None:
        """The engine's own parts (over the executor): block manager, scheduler, outputs."""
        if cfg.speculative_config is not None:
            self._spec_settings(cfg.speculative_config)  # build the default proposer now: errors at start
        self.kv_manager = KVCacheManager(
            self.executor.num_blocks, cfg.block_size, cfg.enable_prefix_caching, self.executor.num_host_blocks
        )
        if self.executor.kv_tiers is not None:  # host and disk tiers below the pool (docs/kv_tiers.md)
            self.kv_manager.tiers = KVTiers(self.kv_manager.pool, self.executor.kv_tiers)
        self.scheduler = Scheduler(
            self.kv_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len,
            cfg.enable_chunked_prefill, cfg.scheduling_policy, cfg.preemption_mode,
            cfg.long_prefill_token_threshold, cfg.max_itl_ratio, cfg.max_loras if cfg.enable_lora else 0,
        )
        emb = model.get_input_embeddings()  # nn.Embedding or a quantized one (QuantEmbedding): no .weight there
        self.vocab_size = getattr(emb, "num_embeddings", None) or emb.weight.shape[0]
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.outputs = OutputProcessor(tokenizer)
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._grammars = None  # the structured-output grammar compiler, built on the first such request
        self._grammars_lock = threading.Lock()
        self._pending: list[RequestOutput] = []  # aborted outputs, reported by the next step()
        self._beam_searches: list[BeamSearch] = []
        self.num_steps = 0
        self._finished_states = self.outputs.finished_queues  # finished requests whose queue is not read yet

    # -- what the execution layer chose (read-only views of Executor.describe()) ---------------------
    @property
    def pool(self):
        """The KV pool (:class:`~hf_paged.executor.kv_pool.KVPool`)."""
        return self.executor.describe().pool

    @property
    def backend(self) -> str:
        """The attention backend in use: "cpu", "torch" or "triton"."""
        return self.executor.describe().backend

    @property
    def packed(self):
        """The model's packed linears (:class:`~hf_paged.model.layers.packed.PackedLinears`), or None."""
        return self.executor.describe().packed

    @property
    def fused(self):
        """The model's fused decoder layers (:class:`~hf_paged.model.layers.fused_decoder.FusedLayers`), or None."""
        return self.executor.describe().fused

    # -- intake -------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        *,
        tokenizer=None,
        return_scores: bool = False,
        queue_outputs: bool = False,
        speculative_config: SpeculativeConfig | dict | None = None,
        stop_at_context: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue one request; returns its id. Bad input raises ValueError/TypeError and changes nothing.

        Args:
            prompt: Text (needs a tokenizer), a list of token ids, or a 1-D integer tensor or NumPy array.
            sampling_params: How to sample (``SamplingParams()`` by default).
            request_id: Your id for it (unique among live requests); a fresh one by default.
            priority: With ``scheduling_policy="priority"``, lower values run first (vLLM's convention).
            tokenizer: A tokenizer for this request's stop strings and text, instead of the engine's.
            return_scores: Keep the processed logits row of every sampled token (HF ``output_scores``),
                readable with :meth:`scores_of`.
            queue_outputs: Keep every output of this request in its own queue, read with :meth:`poll` or
                :meth:`next_output`, whichever thread runs the steps that produce them.
            speculative_config: Speculate for this request with these settings instead of the engine's
                (same keys as the engine's ``speculative_config``).
            stop_at_context: Accept ``max_tokens`` past the context: the request stops at ``max_model_len``
                tokens (``finish_reason="length"``) instead of raising ValueError, as HF ``generate`` does with
                ``max_new_tokens``. By default a prompt + ``max_tokens`` over ``max_model_len`` is refused, as
                the server refuses it.
            lora_request: Run it with this PEFT LoRA adapter (``enable_lora=True``); loaded and checked the
                first time it is seen. None: the base model.
        """
        if sampling_params is not None and getattr(sampling_params, "structured_outputs", None) is not None:
            sampling_params = self.prepare_structured(sampling_params)  # before the lock: steps go on meanwhile
        with self._lock:
            request, state = self._make_request(
                prompt, sampling_params, request_id, priority, tokenizer, return_scores, speculative_config,
                stop_at_context, lora_request,
            )
            self._admit(request, state, queue_outputs)
            return request.request_id

    def _make_request(
        self, prompt, sampling_params, request_id, priority, tokenizer=None, return_scores=False, speculative=None,
        stop_at_context=False, lora_request=None,
    ) -> tuple[Sequence, RequestState]:
        """Validate one request (raising ValueError/TypeError) without admitting it."""
        self._check_usable()
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if params.structured_outputs is not None:
            params = self.prepare_structured(params)
        ids, text = token_ids(prompt, self.tokenizer, self.vocab_size)
        rid = str(next(self._ids)) if request_id is None else request_id
        if not isinstance(rid, str):
            raise TypeError(f"request_id must be a str, got {rid!r}")
        if not rid:
            raise ValueError("request_id must be a non-empty str, got ''")
        if rid in self.outputs.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if params.stop and (tokenizer or self.tokenizer) is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer: pass tokenizer= to the engine")
        outside = [t for t in params.stop_token_ids or () if t >= self.vocab_size]
        if outside:
            raise ValueError(f"stop_token_ids {outside} are outside the vocabulary [0, {self.vocab_size})")
        lora_id = self._lora_id(lora_request)
        request = Sequence(rid, ids, params, self.eos_token_ids, self.max_model_len, prompt=text, priority=priority,
                           lora_int_id=lora_id)
        spec = SpeculativeConfig.from_value(speculative) if speculative is not None else self.config.speculative_config
        # logits processors and stopping criteria see one token at a time: such requests never speculate
        if spec is not None and params.num_speculative_tokens != 0 and not params.has_hooks:
            # settings only: its proposer (a draft model to load, a probe forward) is built at admission, which
            # runs where the steps run (the engine loop's thread), never beside a forward
            request.spec_key, request.spec_k, request.spec_lookahead, request.spec_disable_batch_size = (
                self._spec_settings(spec, build=False)
            )
        self.scheduler.check_request(request)
        if not stop_at_context:
            self._check_context(len(ids), params.max_tokens)
        state = RequestState(rid, text, request.prompt_token_ids, params.n, request.arrival_time, tokenizer)
        if request.spec_key is not None and speculative is not None:
            state.speculative = spec
        if return_scores:
            request.scores = []
            state.scores = {}
        return request, state

    def _check_context(self, prompt_len: int, max_tokens: int) -> None:
        """The server's rule (a 400 there): prompt + max_tokens must fit in max_model_len."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"the prompt has {prompt_len} tokens, which leaves no room to generate within "
                             f"max_model_len={self.max_model_len}")
        if max_tokens > room:
            raise ValueError(f"max_tokens={max_tokens} is too large: the prompt has {prompt_len} tokens and "
                             f"max_model_len is {self.max_model_len}, so at most {room} new tokens fit")

    def _spec_settings(self, spec: SpeculativeConfig, build: bool = True) -> tuple[str, int, int, int | str | None]:
        """(proposer key, k, lookahead slots, batch limit) for a configuration; with ``build``, its proposer is
        made (once per key). Without, only what can be checked cheaply is (a draft model folder exists)."""
        key = spec_key(spec)
        if build and not self.executor.has_proposer(key):
            self.executor.add_proposer(key, spec)
        elif not build:
            check_speculative(spec)
        # a draft model or head writes its KV up to k - 1 slots past the sequence while drafting
        lookahead = spec.num_speculative_tokens if spec.method in ("draft_model", "eagle3", "eagle") else 0
        return key, spec.num_speculative_tokens, lookahead, spec.disable_by_batch_size

    def _admit(self, request: Sequence, state: RequestState, queue_outputs: bool) -> None:
        if state.request_id in self.outputs.requests:
            raise ValueError(f"request id {state.request_id!r} is already in use")
        if state.speculative is not None and not self.executor.has_proposer(request.spec_key):
            self.executor.add_proposer(request.spec_key, state.speculative)
        self.scheduler.add_request(request)
        self.outputs.add(state, request, request.sampling_params.stop, with_queue=queue_outputs)

    def abort(self, request_id: str) -> bool:
        """Stop a request (every sample of it) and free its blocks; False if unknown or already finished."""
        with self._lock:
            state = self.outputs.state_of(request_id)
            if state is None:
                return False
            for seq in state.seqs.values():
                if not seq.is_finished:
                    self.scheduler.abort_request(seq.seq_id)
            self._pending.append(self.outputs.emit(state))
            return True

    def fail_requests(self, request_ids: abc.Sequence[str], message: str) -> list[RequestOutput]:
        """Finish requests with ``finish_reason="error"`` and ``message``, free their blocks, and return (and
        queue) their outputs; unknown or finished ids are skipped. For a driver whose ``step()`` raised."""
        with self._lock:
            failed = []
            for rid in request_ids:
                state = self.outputs.state_of(rid)
                for seq in state.seqs.values() if state is not None else ():
                    if not seq.is_finished:
                        self.scheduler.finish_request(seq.seq_id, SequenceStatus.FINISHED_ERROR, message)
                        failed.append(seq)
            return self.outputs.process(failed)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the requests that got tokens, finished, or were aborted since.

        An exception in the forward fails the requests of this step (``finish_reason="error"``, the message
        in ``CompletionOutput.error``) and nothing else; the engine goes on.
        """
        with self._lock:
            self._check_usable()
            if not model_patches.attention_active(self.model):
                raise RuntimeError(
                    "the model no longer runs the 'hf_paged' attention (its attention implementation was changed "
                    f"to {self.model.config._attn_implementation!r} outside this engine); generating now would "
                    "give wrong tokens. Build a new engine."
                )
            pending, self._pending = self._pending, []
            try:
                return pending + self._step()
            except BaseException:
                self._pending = pending + self._pending  # abort outputs are never lost
                raise

    def _step(self) -> list[RequestOutput]:
        self._drop_stale_prefix_cache()
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.executor.failure is None:  # a failed executor holds no state to drop
                self.executor.execute_model(out)  # drops the finished sequences' state
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("scheduler made no progress with requests pending (a bug: please report)")
            return []
        try:
            started = time.perf_counter()
            result = self.executor.execute_model(out)
            self.scheduler.observe_step(out, time.perf_counter() - started, result)
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep the engine usable
            if self.executor.failure is not None:  # failed for good: it logged why, once; one short line will do
                return self._fail_step(out, f"engine failed: {self.executor.failure}")
            logger.exception("engine step failed; failing the %d sequences it ran", len(out.scheduled))
            return self._fail_step(out, f"engine step failed: {type(e).__name__}: {e}")
        # one way: the beam searches and stop strings decide from the step's results; the scheduler applies it
        beams = []
        for search in list(self._beam_searches):
            update = search.add_rows(result.beam_rows)
            if update is not None:
                beams.append(update)
            if search.done:
                self._beam_searches.remove(search)
        changed = self.scheduler.update(out, result, beams)
        for seq_id, status, error in self.outputs.check_stops(changed):
            self.scheduler.finish_request(seq_id, status, error)
        self.num_steps += 1
        return self.outputs.process(changed, result.scores)

    def _fail_step(self, out: SchedulerOutput, message: str) -> list[RequestOutput]:
        failed = []
        for seq_id in [s.seq_id for s in out.scheduled] + out.preempted_seq_ids + out.swapped_in_seq_ids:
            request = self.scheduler.sequences.get(seq_id)
            if request is None or (seq_id in out.preempted_seq_ids and request.status is not SequenceStatus.SWAPPED):
                continue  # recompute victims lost nothing
            self.scheduler.finish_request(seq_id, SequenceStatus.FINISHED_ERROR, message)
            failed.append(request)
        for search in list(self._beam_searches):
            if any(seq_id not in self.scheduler.sequences for row in search.running for seq_id in row):
                search.error = message
                self._abort_beam_search(search)
        return self.outputs.process(failed)

    # -- state --------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of queues, KV usage, prefix-cache and preemption counters."""
        with self._lock:
            return EngineStats.collect(self.scheduler, self.kv_manager, self.outputs.num_finished, self.num_steps)

    @property
    def failure(self) -> str | None:
        """Why no step can run any more (a tensor-parallel rank died), in one short line; None while steps can."""
        return self.executor.failure

    def check_health(self) -> str | None:
        """Look for an executor failure between steps (a dead tensor-parallel worker); return :attr:`failure`."""
        with self._lock:
            return self.executor.check_health() if not self._closed else self.executor.failure

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this PagedGenerator is closed; build a new one to generate")

    def close(self) -> None:
        """Abort what is left, drop the KV pool, and (last engine on this model) restore the model."""
        with self._lock:
            if self._closed:
                return
            for rid in list(self.outputs.requests):
                self.abort(rid)
            for search in list(self._beam_searches):
                self._abort_beam_search(search)
            self._closed = True
            self.executor.close()
        self._close_grammars()

    def __enter__(self) -> PagedGenerator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
