"""``hf-paged bench WORKLOAD``: the standard workloads of docs/benchmarks.md against their baselines, in one run."""

from hf_paged.bench.workloads import WORKLOADS

__all__ = ["WORKLOADS"]
