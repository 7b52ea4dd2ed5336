"""hf_paged's own layer objects, swapped into a model at load (``linear``: tensor-parallel linears)."""

from hf_paged.model.layers.parallel import COMM, CommStats, ParallelLinear, linear_of  # noqa: F401
