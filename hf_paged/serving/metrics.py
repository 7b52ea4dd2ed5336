"""Prometheus metrics of an :class:`~hf_paged.serving.AsyncPagedEngine`, named after vLLM's (``hf_paged:`` prefix).

Engine counters and gauges are read from one ``engine.stats()`` snapshot per scrape (taken on the loop
thread); latency histograms are fed by the loop after each step. Needs ``pip install hf-paged[serve]``.
"""

from __future__ import annotations

import logging

from hf_paged.outputs import EngineStats
from hf_paged.serving.common import WorkerPool
from hf_paged.serving.engine_loop import AsyncPagedEngine, StepInfo

logger = logging.getLogger(__name__)

PREFIX = "hf_paged:"

# name (without prefix), kind, help; the engine-state metrics come from EngineStats at scrape time
ENGINE_METRICS = [
    ("num_requests_running", "gauge", "Sequences in the running batch."),
    ("num_requests_waiting", "gauge", "Requests waiting to be scheduled (the bounded queue)."),
    ("num_requests_swapped", "gauge", "Sequences swapped out to host memory."),
    ("kv_cache_usage_perc", "gauge", "KV-cache usage: fraction of the pool's blocks in use (1 = 100 percent)."),
    ("kv_cache_blocks", "gauge", "Blocks in the KV-cache pool."),
    ("prompt_tokens", "counter", "Prompt tokens admitted (prefilled or served by the prefix cache)."),
    ("generation_tokens", "counter", "Tokens generated."),
    ("num_preemptions", "counter", "Preemptions (recompute and swap)."),
    ("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache."),
    ("spec_decode_num_drafts", "counter", "Speculative-decoding drafts (0 until speculative decoding runs)."),
    ("spec_decode_num_draft_tokens", "counter", "Speculative draft tokens proposed."),
    ("spec_decode_num_accepted_tokens", "counter", "Speculative draft tokens accepted."),
    ("iteration_steps", "counter", "Engine steps run."),
    # KV tiers below the pool (docs/kv_tiers.md); all 0 without kv_offload_gb / prefix_cache_dir
    ("kv_tier_host_hits", "counter", "Prefix blocks promoted from the host tier."),
    ("kv_tier_disk_hits", "counter", "Prefix blocks promoted from the disk tier."),
    ("kv_tier_demotions", "counter", "Cached blocks evicted from the pool and kept in the host tier."),
    ("kv_tier_host_evictions", "counter", "Blocks dropped from a full host tier."),
    ("kv_tier_disk_bytes_read", "counter", "Bytes read from the disk tier."),
    ("kv_tier_disk_bytes_written", "counter", "Bytes written to the disk tier."),
    ("kv_tier_disk_files_skipped", "counter", "Disk-tier files that failed their checks (recomputed, never served)."),
    ("kv_tier_disk_files_evicted", "counter", "Disk-tier files deleted to keep the folder under its cap."),
    ("kv_tier_disk_blocks_read_ahead", "counter", "Disk-tier blocks read in the background before their lookup."),
]

# EngineStats.kv_tiers key of each kv_tier_* metric
KV_TIER_KEYS = ("host_hits", "disk_hits", "demotions", "host_evictions", "disk_bytes_read", "disk_bytes_written",
                "disk_files_skipped", "disk_files_evicted", "disk_blocks_read_ahead")

LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]


def _require():
    try:
        import prometheus_client
    except ImportError as e:  # optional dependency
        raise ImportError("metrics need prometheus-client: pip install hf-paged[serve]") from e
    return prometheus_client


def engine_values(stats: EngineStats, num_waiting: int) -> dict[str, float]:
    """The engine-state metrics' values from one stats snapshot."""
    return {
        "num_requests_running": stats.num_running,
        "num_requests_waiting": num_waiting,
        "num_requests_swapped": stats.num_swapped,
        "kv_cache_usage_perc": stats.kv_usage,
        "kv_cache_blocks": stats.num_kv_blocks,
        "prompt_tokens": stats.num_prompt_tokens,
        "generation_tokens": stats.num_generated_tokens,
        "num_preemptions": sum(stats.num_preemptions.values()),
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "spec_decode_num_drafts": stats.spec_num_drafts,
        "spec_decode_num_draft_tokens": stats.spec_num_draft_tokens,
        "spec_decode_num_accepted_tokens": stats.spec_num_accepted_tokens,
        "iteration_steps": stats.num_steps,
        **{f"kv_tier_{key}": stats.kv_tiers.get(key, 0) for key in KV_TIER_KEYS},
    }


class ServingMetrics:
    """The Prometheus registry of one served engine.

    Args:
        engine: The loop to observe (histograms are fed after each of its steps).
        model_name: The ``model_name`` label on every metric (as vLLM labels them).
        pool: The server's request workers, whose refusals (too many requests being parsed) count as
            ``queue_full`` rejections beside the engine's.
        compile_pool: The server's grammar compile thread, whose refusals (too many requests waiting for their
            grammar) count as ``queue_full`` too.
    """

    def __init__(self, engine: AsyncPagedEngine, model_name: str, pool: WorkerPool | None = None,
                 compile_pool: WorkerPool | None = None) -> None:
        prom = _require()
        self.engine = engine
        self.pool = pool
        self.compile_pool = compile_pool
        self.model_name = model_name
        self.registry = prom.CollectorRegistry()
        self._stats: EngineStats | None = None
        self._num_waiting = 0
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: list[float]):
            return prom.Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (arrival to first token).",
                         LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens of a request.", LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency (arrival to finish).",
                        LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time a request waited before it was first scheduled.",
                          LATENCY_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Generated tokens per finished request (all samples).",
                            TOKEN_BUCKETS)
        self.success = prom.Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                    ["model_name", "finished_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(model_name, reason)
        self.model_requests = prom.Counter(
            PREFIX + "model_requests", "Requests submitted per served model: the base model or a LoRA adapter.",
            ["model_name", "lora_name"], registry=self.registry)
        self.registry.register(_EngineCollector(self))
        engine.add_observer(self.observe)

    def count_model(self, name: str, count: int = 1) -> None:
        """Count ``count`` requests for ``name`` (the base model's name, or a LoRA adapter's)."""
        self.model_requests.labels(self.model_name, name).inc(count)

    def observe(self, info: StepInfo) -> None:
        """Feed the histograms from one step (runs on the loop thread)."""
        for seconds in info.queue_times:
            self.queue.observe(seconds)
        for seconds in info.token_intervals:
            self.itl.observe(seconds)
        for stream in info.finished:
            out = stream.last
            if out is None:
                continue
            if out.first_token_time is not None:
                self.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
            self.e2e.observe(max(0.0, (out.finish_time or info.end) - out.arrival_time))
            self.prompt_len.observe(len(out.prompt_token_ids))
            self.gen_len.observe(sum(len(c.token_ids) for c in out.outputs))
            reason = out.outputs[0].finish_reason or "abort"
            self.success.labels(self.model_name, reason).inc()

    async def render(self) -> bytes:
        """The text exposition of every metric, with a fresh engine snapshot."""
        try:
            self._stats = await self.engine.astats()
        except Exception:  # noqa: BLE001 - a closed engine: report the last snapshot
            logger.debug("no engine stats for this scrape", exc_info=True)
        self._num_waiting = self.engine.num_waiting
        return _require().generate_latest(self.registry)

    def render_blocking(self, timeout: float = 30.0) -> bytes:
        """:meth:`render` from a thread other than the engine loop's (a replica's metrics reporter)."""
        try:
            self._stats = self.engine.stats(timeout)
        except Exception:  # noqa: BLE001 - a closed engine: report the last snapshot
            logger.debug("no engine stats for this scrape", exc_info=True)
        self._num_waiting = self.engine.num_waiting
        return _require().generate_latest(self.registry)

    @property
    def content_type(self) -> str:
        return _require().CONTENT_TYPE_LATEST


class _EngineCollector:
    def __init__(self, metrics: ServingMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.metrics._stats
        values = engine_values(stats, self.metrics._num_waiting) if stats is not None else {}
        for name, kind, doc in ENGINE_METRICS:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.metrics.model_name], values.get(name, 0))
            yield family
        rejected = CounterMetricFamily(
            PREFIX + "requests_rejected", "Requests refused when submitted (HTTP 503), by reason: queue_full "
            "(max_waiting_requests were waiting to be scheduled, or to be parsed, or too many for the grammar compile "
            "thread) or engine_closed; never counted "
            "as finished.", labels=["model_name", "reason"])
        counts = dict(self.metrics.engine.num_rejected)
        for pool in (self.metrics.pool, self.metrics.compile_pool):
            if pool is not None:
                counts["queue_full"] = counts.get("queue_full", 0) + pool.num_rejected
        for reason, count in counts.items():
            rejected.add_metric([self.metrics.model_name, reason], count)
        yield rejected
        # as vLLM: accepted drafts by draft position (mean acceptance length = 1 + accepted / drafts)
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Speculative draft tokens accepted, by draft position "
            "(0: the first draft of a step).", labels=["model_name", "position"])
        for position, count in enumerate(stats.spec_accepted_per_position if stats is not None else ()):
            per_position.add_metric([self.metrics.model_name, str(position)], count)
        yield per_position

    def describe(self):
        return []
