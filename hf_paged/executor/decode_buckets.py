"""Bucketed static-shape decode: persistent input buffers, padded batches, one replayable forward per bucket.

A decode step (every scheduled sequence adds the same number ``q`` of query tokens: 1, or 1 + k when it
verifies k drafts) is padded up to the smallest bucket of sequences that holds it. Inputs are copied into
buffers allocated once, so every replay of a bucket sees the same tensors; the padding rows have
``slot_mapping = -1`` (never written) and ``seq_lens = 0`` (nothing read). Per bucket, the forward is

- ``"cuda_graphs"``: captured once into a CUDA graph (one memory pool shared by the buckets) and replayed;
- ``"inductor"``: compiled by ``torch.compile`` (inductor; artifacts cached on disk under
  ``$HF_PAGED_CACHE/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set);
- ``"static"``: run eagerly on the padded buffers (the CPU-testable twin of the two above).

Steps with LoRA adapter rows (``lora``: the engine's :class:`~hf_paged.lora.manager.LoRAManager`) run here too in
"static" and "cuda_graphs": their rows' slots go into a static index buffer (``lora_index``, ``-1`` on base and
padding rows) filled before each replay, and every linear with adapter tensors runs the per-token shrink and
expand kernels over it (:mod:`hf_paged.kernels.lora`), so one forward per bucket serves any mix of adapters. Such
a forward is made apart from the base one (key ``(bucket, q, generation)``) and made again when another linear
gets adapter tensors (the stacked tensors are otherwise written in place, never replaced). "inductor" leaves
adapter steps to the eager path: the slots read the step's plan, a Python object, which dynamo would guard on
and recompile for at every step.

Steps the buckets do not cover (prefill chunks, mixed steps, more sequences than the largest bucket, uneven
query lengths) run on the dynamic eager path. The attention op of a static step is
``torch.ops.hf_paged.static_paged_attention`` (:mod:`hf_paged.kernels.graph_ops`), running the engine's
attention backend's kernels: Triton, torch, or torch with the native CPU kernel. A CUDA graph captures only the
Triton ones (the torch path reads the step's row count on the host), so ``"cuda_graphs"`` needs the "triton"
backend.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

import torch

from hf_paged.attention.function import METADATA_KWARG, AttentionMetadata, engine_forward
from hf_paged.attention.layer import AttentionLayers
from hf_paged.core.scheduler_output import ScheduledSequence
from hf_paged.executor.input_batch import BlockTables, pack_step
from hf_paged.config import DECODE_MODES as MODES, check_buckets, default_buckets  # noqa: F401 - re-exported
from hf_paged.env import cache_dir

logger = logging.getLogger(__name__)

# transformers builds no mask when it is handed a 4-D one; the paged kernels mask by themselves. Without it
# the mask builder reads a context variable, which torch.compile cannot trace (a graph break per forward).
_NO_MASK = torch.zeros(1, 1, 1, 1, dtype=torch.bool)


def resolve_mode(mode: str, enforce_eager: bool, device: torch.device, backend: str | None = None) -> str | None:
    """The decode mode to use, or None for the dynamic eager path only.

    "auto" is CUDA graphs on CUDA and the native decode program (:mod:`hf_paged.executor.native_program`: the
    step's kernel calls recorded once and replayed, no padding) on CPU, where the model fits it; the engine
    falls back to the dynamic eager path where it does not. The padded static forward and inductor measured
    no faster than the dynamic path with packed linears on an AVX2 host (docs/performance_log.md), inductor at
    about a minute of compilation per bucket: ask for them explicitly.

    ``backend`` is the engine's resolved attention backend: CUDA graphs capture the Triton kernels only, so
    with another one "auto" decodes eagerly on CUDA and an explicit "cuda_graphs" is refused.
    """
    if enforce_eager:
        return None
    if mode == "auto":
        if device.type == "cuda":
            if backend not in (None, "triton"):
                logger.info("decode buckets: no CUDA graphs with attention_backend=%r (they capture the Triton "
                            "kernels); decoding eagerly", backend)
                return None
            return "cuda_graphs"
        return "native" if device.type == "cpu" else None
    if mode == "cuda_graphs" and device.type != "cuda":
        raise ValueError(f"decode_runner='cuda_graphs' needs a CUDA model, this one is on {device}")
    if mode == "cuda_graphs" and backend not in (None, "triton"):
        raise ValueError(
            f"decode_runner='cuda_graphs' captures the Triton attention kernels, but the engine's attention backend "
            f"is {backend!r}; use attention_backend='triton' (or 'auto' with triton installed), or "
            "decode_runner='static' / 'inductor'"
        )
    if mode == "native" and device.type != "cpu":
        raise ValueError(f"decode_runner='native' runs CPU kernels, this model is on {device}")
    return mode


class DecodeBuckets:
    """Static buffers, buckets and one replayable forward per (bucket, query length).

    Args:
        model: The HF model (attention "hf_paged").
        attention: The engine's attention layer objects (its pool and backend).
        block_size: Tokens per block.
        mode: "static", "cuda_graphs" or "inductor".
        buckets: Sequence counts to pad to (increasing).
        max_query_len: Largest query length per sequence served (1 + the most drafts per step).
        max_model_len: Longest sequence (block-table width; ``max_seqlen_k`` of the CUDA kernels).
        block_tables: The model runner's persistent block tables (the step's rows are copied from them).
    """

    def __init__(
        self, model: torch.nn.Module, attention: AttentionLayers, block_size: int, mode: str, buckets: Sequence[int],
        max_query_len: int, max_model_len: int, block_tables: BlockTables, agree=None, lora=None,
    ) -> None:
        # agree: tensor parallelism: the smallest of every rank's value (1: this rank built a bucket, 0: it could
        # not), so that all ranks take a bucket or none: a padded step and an unpadded one run collectives of
        # different sizes
        self.agree = agree
        self.lora = lora  # the LoRA manager, or None
        self.num_lora_replays = 0
        self.model = model
        self.layers = attention
        self.block_size = block_size
        self.mode = mode
        self.buckets = tuple(buckets)
        self.max_query_len = max_query_len
        self.max_model_len = max_model_len
        self.tables = block_tables
        self.attention = attention.backend.static()  # the engine's backend, as one graph-safe op a layer
        from hf_paged.kernels import graph_ops  # imported by static(): the op is registered

        self._new_step = graph_ops.new_step
        device = attention.kv_caches[0][0].device
        self.device = device
        max_seqs = self.buckets[-1]
        max_tokens = max_seqs * max_query_len
        max_blocks = -(-max_model_len // block_size)
        # persistent inputs: every replay reads these same tensors
        self.input_ids = torch.zeros(1, max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_seqs, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.no_mask = _NO_MASK.to(device)
        # each row's LoRA slot (-1: base or padding), read by the adapter forwards' kernels
        self.lora_index = None if lora is None else torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self.num_replays = 0
        self.num_builds = 0
        self.build_seconds: dict[tuple[int, int], float] = {}
        self._mempool = None
        self._compiled = None
        self.disabled_reason: str | None = None

    # -- which steps -------------------------------------------------------------------------------
    def bucket_for(self, num_seqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    @property
    def serves_lora(self) -> bool:
        """Whether steps with adapter rows may run here: "static" and "cuda_graphs" (a forward per bucket whose
        adapter kernels read the static ``lora_index``), not "inductor" (see the module docstring)."""
        return self.lora is not None and self.mode in ("static", "cuda_graphs")

    def accepts(self, scheduled: list[ScheduledSequence]) -> bool:
        return self.plan(scheduled) is not None

    def plan(self, scheduled: list[ScheduledSequence]) -> tuple[int, int] | None:
        """(bucket, query length) when this step is a uniform decode step the buckets cover, else None."""
        if self.disabled_reason is not None or not scheduled:
            return None
        q = scheduled[0].num_new_tokens
        if q > self.max_query_len:
            return None
        for item in scheduled:
            # a decode row: samples, adds q tokens, and all of them are the last token + its drafts
            if not item.sample or item.num_new_tokens != q or item.num_draft_tokens != q - 1:
                return None
        bucket = self.bucket_for(len(scheduled))
        return None if bucket is None else (bucket, q)

    # -- one step ----------------------------------------------------------------------------------
    def fill(self, scheduled: list[ScheduledSequence], bucket: int, q: int) -> None:
        """Copy the step into the persistent buffers; rows past the real ones become padding."""
        n = len(scheduled)
        ids, positions, slots, seq_lens, _cu, _rows = pack_step(scheduled, self.tables.lists, self.block_size)
        tokens, padded = n * q, bucket * q
        dev = self.device
        self.input_ids[0, :tokens].copy_(torch.tensor(ids, dtype=torch.long), non_blocking=True)
        self.positions[0, :tokens].copy_(torch.tensor(positions, dtype=torch.long), non_blocking=True)
        self.slot_mapping[:tokens].copy_(torch.tensor(slots, dtype=torch.long), non_blocking=True)
        self.input_ids[0, tokens:padded].zero_()
        self.positions[0, tokens:padded].zero_()
        self.slot_mapping[tokens:padded].fill_(-1)
        width = min(self.block_tables.shape[1], max(len(self.tables.lists[item.seq_id]) for item in scheduled))
        rows = self.tables.gather([item.seq_id for item in scheduled], width)
        self.block_tables[:n, :width].copy_(rows.to(dev, non_blocking=True))
        self.block_tables[:n, width:].zero_()
        self.block_tables[n:bucket].zero_()
        lens = torch.zeros(bucket, dtype=torch.int32)
        lens[:n] = torch.tensor(seq_lens, dtype=torch.int32)
        self.seq_lens[:bucket].copy_(lens.to(dev, non_blocking=True))
        self.cu_seqlens_q[: bucket + 1].copy_(torch.arange(0, padded + 1, q, dtype=torch.int32).to(dev))
        self._new_step(self.block_tables)

    def run(self, step) -> torch.Tensor | None:
        """Logits ``[len(scheduled) * q, V]`` of every real query token (a sequence's rows are consecutive: all
        of them are sampled rows), or None when the step has no bucket or this bucket cannot be built (the
        buckets are then disabled, with one warning). Steps that want hidden states are the eager runner's."""
        if step.hidden_layers:
            return None
        plan = None if self.lora is None else self.lora.plan  # a step with adapter rows (set for this step)
        if plan is not None and not self.serves_lora:
            return None
        planned = self.plan(step.scheduled)
        if planned is None:
            return None
        scheduled, (bucket, q) = step.scheduled, planned
        self.fill(scheduled, bucket, q)
        if plan is None:
            return self._replay(scheduled, (bucket, q))
        own = self.lora.begin_static_step(self.lora_index[: bucket * q])
        try:
            generation = self.lora.generation
            for stale in [k for k in self.graphs if len(k) == 3 and k[2] != generation]:
                del self.graphs[stale]  # made before another linear got adapter tensors: it lacks their kernels
            logits = self._replay(scheduled, (bucket, q, generation))
        finally:
            self.lora.end_static_step(own)
        self.num_lora_replays += logits is not None
        return logits

    def _replay(self, scheduled: list[ScheduledSequence], key: tuple[int, ...]) -> torch.Tensor | None:
        """Run the forward of ``key`` (``(bucket, q)``, and the LoRA generation for adapter steps), built on
        first use; None when it cannot be built."""
        bucket, q = key[0], key[1]
        fn = self.graphs.get(key)
        if fn is None:
            why = None
            try:
                fn = self._build(bucket, q)
            except Exception as e:  # noqa: BLE001 - never a crash: the dynamic eager path serves instead
                why = f"{type(e).__name__}: {e}"
            if self.agree is not None and self.agree(0 if why else 1) == 0 and why is None:
                why = "another tensor-parallel rank could not build it"
            if why is not None:
                self.disable(f"building decode bucket {bucket} x {q} ({self.mode}) failed: {why}")
                return None
            self.graphs[key] = fn
        logits = fn()
        self.num_replays += 1
        return logits[: len(scheduled) * q]

    def disable(self, reason: str) -> None:
        """Stop using the buckets (every later step runs eagerly) and say why, once."""
        if self.disabled_reason is None:
            logger.warning("%s; decoding eagerly from now on", reason)
        self.disabled_reason = reason
        self.graphs.clear()

    def weights_changed(self) -> None:
        """A weight changed in place or was replaced: graphs are rebuilt (recaptured) on next use. Inductor
        reads the live weights (they are not frozen), and its guards recompile for replaced ones."""
        self.graphs.clear()

    # -- building a bucket -------------------------------------------------------------------------
    def _forward(self, bucket: int, q: int) -> tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]:
        """The padded forward of one bucket over views of the persistent buffers."""
        padded = bucket * q
        views = (
            self.input_ids[:, :padded], self.positions[:, :padded], self.slot_mapping[:padded],
            self.block_tables[:bucket], self.seq_lens[:bucket], self.cu_seqlens_q[: bucket + 1],
        )
        return _dynamic_forward(self), views

    def _build(self, bucket: int, q: int) -> Callable[[], torch.Tensor]:
        start = time.perf_counter()
        forward, views = self._forward(bucket, q)
        if self.mode == "cuda_graphs":
            fn = self._capture(forward, views)
        elif self.mode == "inductor":
            compiled = self._compiler()
            compiled(*views)  # compile this bucket's shapes now
            fn = lambda: compiled(*views)  # noqa: E731
        else:
            fn = lambda: forward(*views)  # noqa: E731
        seconds = time.perf_counter() - start
        self.num_builds += 1
        self.build_seconds[(bucket, q)] = seconds
        logger.info("decode bucket %d x %d (%s) ready in %.2f s", bucket, q, self.mode, seconds)
        return fn

    def _compiler(self):
        if self._compiled is None:
            configure_inductor(len(self.buckets) * self.max_query_len)
            self._compiled = torch.compile(_dynamic_forward(self), dynamic=False)
        return self._compiled

    def _capture(self, forward, views) -> Callable[[], torch.Tensor]:
        """Warm up on a side stream, capture one CUDA graph into the shared pool, replay it from then on."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward(*views)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_allocated(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            logits = forward(*views)
        logger.info("captured a CUDA graph: %.1f MiB more allocated",
                    (torch.cuda.memory_allocated(self.device) - before) / 2**20)

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay


def _dynamic_forward(runner: DecodeBuckets):
    """One function for every bucket (torch.compile specializes it per input shape)."""

    def forward(input_ids, positions, slot_mapping, block_tables, seq_lens, cu_seqlens_q):
        q = input_ids.shape[1] // block_tables.shape[0]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=q, max_seqlen_k=runner.max_model_len, layers=runner.layers, impl=runner.attention,
        )
        with engine_forward():
            out = runner.model(input_ids=input_ids, position_ids=positions, attention_mask=runner.no_mask,
                               use_cache=False, **{METADATA_KWARG: meta})
        return out.logits[0]

    return forward


def configure_inductor(num_shapes: int) -> None:
    """Inductor settings for the decode graphs: one compile thread (worker pools oversubscribed our 2 cores
    and slowed every later step), a recompile limit that fits every bucket, and the on-disk FX graph cache in
    hf_paged's cache folder. Weights are not frozen: freezing (which prepacks GEMM weights) measured no faster
    here, bypasses the on-disk cache, and would serve stale weights after a training step."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    inductor_config.freezing = False
    inductor_config.compile_threads = 1
    inductor_config.fx_graph_cache = True
    limit = max(8, 2 * num_shapes)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name) and getattr(dynamo_config, name) < limit:
            setattr(dynamo_config, name, limit)
