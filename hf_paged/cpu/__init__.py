"""Old home of the CPU layers, kept one release so that their old import paths resolve, with a
DeprecationWarning, to the new modules (the table in ``hf_paged/_moved.py``): the linear and decoder layer
objects now live in ``hf_paged/model/layers/``, the native decode program in ``hf_paged/executor/``, the
packings and quantized formats in ``hf_paged/kernels/cpu/``."""
