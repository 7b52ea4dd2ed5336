"""The Triton kernels: KV store, split-K decode, varlen attention (on CPU only under
``TRITON_INTERPRET=1``). Imported on first use: the package works without triton."""
