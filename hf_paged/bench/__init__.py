"""``hf-paged bench WORKLOAD``: the standard workloads of BENCHMARKS.md against their baselines, in one run."""

from hf_paged.bench.workloads import WORKLOADS

__all__ = ["WORKLOADS"]
