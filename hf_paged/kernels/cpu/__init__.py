"""The CPU kernels: native C attention, GEMM and fused ops built from ``csrc/`` with the host compiler
(``native.py``, at the ISA level of ``isa.py``), each probed against torch before use (``probes.py``),
and kernel timings kept across runs (``tuning_store.py``)."""
