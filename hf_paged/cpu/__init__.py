"""The CPU backend: everything that makes the CPU path fast, probed on the host before use.

- ``attention.py``: the native paged attention and KV store (``csrc/paged_attention_cpu.c``), ``NativeStep``.
- ``fused_ops.py``, ``fused_layers.py``: the fused Llama/Mistral/Qwen2 decoder-layer forward and its kernels.
- ``packed_linear.py``, ``packed_model.py``, ``native_gemm.py``: packed linear weights (our own GEMM, oneDNN,
  MKL) and the choice between them, timed on the host.
- ``native_program.py``, ``program_fit.py``: the native decode program (a step's C kernel calls recorded once
  and replayed), and which models fit it.
- ``native.py``: builds the C sources in ``csrc/`` with the host compiler; ``probes.py``: every fast path is tried
  once per process and dtype against plain torch before the engine uses it.
"""
