"""The CPU model layers and the native decode program (the kernels they call live in ``hf_paged/kernels/cpu/``).

- ``fused_layers.py``: the fused Llama/Mistral/Qwen2 decoder-layer forward (its kernels: ``kernels/cpu/fused_ops.py``).
- ``packed_linear.py``, ``packed_model.py``: packed linear weights (our own GEMM in ``kernels/cpu/native_gemm.py``,
  oneDNN, MKL) and the choice between them, timed on the host.
- ``quant_linear.py``, ``quant_formats.py``, ``quantize_model.py``, ``quant_modes.py``: quantized linears.
- ``native_program.py``, ``program_fit.py``, ``quant_program.py``: the native decode program (a step's C kernel
  calls recorded once and replayed), and which models fit it.

These files are being rewritten as owned layers (``model/layers/``) and step runners (``executor/``).
"""
