"""The CPU twin of a CUDA graph: a fused Llama-family decode step as a fixed list of native kernel calls.

With the fused layers (:mod:`hf_paged.model.layers.fused_decoder`) and our own packed GEMM, a CPU decode step is ~12 C
calls a layer; what remains around them is Python: transformers' model and layer ``forward`` calls, the
module hooks machinery, each call's argument checks and tensor allocations, ~80 us a layer on the 2-core
hosts, i.e. ~2.4 ms of a 30-layer batch-1 step. Like a CUDA graph, a :class:`DecodeProgram` records the step
once, as the kernel calls with their arguments already converted, over persistent buffers (shared by every
layer: the step's activations never leave a few arrays), and each step replays that list. Unlike a graph
it needs no buckets: the row count is one argument the calls read (a shared ``ctypes`` cell), so a batch is
never padded; the per-step inputs (token ids, cos/sin, slots, block tables) are pointer cells too. Linears
packed for our GEMM are C calls like the rest; other packings (oneDNN, MKL, upcast) run their own ``linear``
from the program, the result copied into the step's buffer.

The program computes what the fused forward computes, call for call (same kernels, same inputs, same
order of the residual adds), so its logits are those of the eager engine. It runs a step only where every
sequence takes the native attention (the step's ``NativeStep``: decodes, draft verification, short prompts)
and falls back to the eager forward for everything else, and while a module hook it would skip is
registered; it records itself again when something it recorded changed (:meth:`DecodeProgram._valid`).

With multi-LoRA (``lora``: the engine's :class:`~hf_paged.lora.manager.LoRAManager`) the program records two
call lists: the base one, and the same calls with the LoRA deltas after every adaptable projection's GEMM
(:func:`~hf_paged.executor.program_ops.lora_delta_ops`: per member slot one call of the CPU LoRA kernel, its
fixed arguments prepared at recording, reading the step's per-token slot index from a pointer cell; a Python
:class:`~hf_paged.executor.program_ops.Delta` for slots the kernel does not take). A step with adapter rows (the
manager's ``plan`` set for it) replays the second; the deltas are the slots' own computation
(:meth:`~hf_paged.lora.slots.LoRASlot.add_delta`), so adapter rows get the eager forward's logits.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from hf_paged.attention.layer import AttentionLayers
from hf_paged.model import patches as model_patches
from hf_paged.executor.program_fit import hooks, skipped_modules, why_not
from hf_paged.executor.program_ops import CallLists
from hf_paged.executor.program_reads import RecordedReads
from hf_paged.executor.program_record import Unfit, record
from hf_paged.executor.quant_program import QuantEmbedding
from hf_paged.kernels.cpu import attention as cpu_attention, call_list

logger = logging.getLogger(__name__)

_MIN_ROWS = 16


class DecodeProgram:
    """One model's decode steps replayed as native calls over persistent buffers (see the module docstring).

    Args:
        model: A Llama/Mistral/Qwen2 causal LM (checked with :func:`hf_paged.executor.program_fit.why_not`).
        layers: The engine's attention layer objects (their pool tensors and the settings learned at start).
        max_rows: The most tokens a native step can have (``max_num_seqs`` x the longest native query).
        owner: The model whose packing and fused layers ``model`` runs (a ``self:N`` draft's view runs the
            target's); ``model`` itself by default.
    """

    def __init__(self, model: torch.nn.Module, layers: AttentionLayers, max_rows: int,
                 owner: torch.nn.Module | None = None, lora=None) -> None:
        self.model = model
        self.lora = lora  # the LoRA manager whose slots the delta ops run, or None (base steps only)
        self.num_lora_runs = 0  # steps with adapter rows replayed
        self.owner = model if owner is None else owner
        self.attention_layers = layers
        self.kv_caches = layers.kv_caches
        self.max_rows = max_rows
        self.capacity = 0
        self.num_runs = 0  # steps replayed
        self.num_records = 0  # times the call list was (re)built
        self.threads = 0
        self.why_not = ""  # why the last step could not run as the program ("" when it could)
        self._failures = self._retry_in = 0
        self._ops: CallLists | None = None  # the recorded calls (the LM head's skipped when no row is sampled)
        self._lora_ops: CallLists | None = None  # _ops with the LoRA delta ops (a step with adapter rows)
        self.logits_capacity = 0
        self._rows, self._sampled = ctypes.c_int(0), ctypes.c_int(0)
        self._token_slot = ctypes.c_void_p(0)  # the step plan's int32 [rows] slot index (the LoRA kernel's calls)
        self._index: torch.Tensor | None = None
        self._tokens = ctypes.c_int64(0)
        self._cos, self._sin, self._slots = ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_void_p(0)
        self._tables, self._lens, self._cu, self._ids = (ctypes.c_void_p(0) for _ in range(4))
        self._table_stride, self._num_ids, self._max_q = ctypes.c_int64(0), ctypes.c_int(0), ctypes.c_int(0)
        self._packing = None
        self._reads = RecordedReads([], [], [], [])  # what the recorded calls read, checked before each replay
        self._keep: list = []
        self.capture: tuple[int, ...] = ()  # decoder layers whose outputs the program copies out (set_capture)
        self._caps: dict[int, torch.Tensor] = {}

    def prepare(self) -> str:
        """Record the program for a first small step now (at engine start); the reason it cannot ("" if it can)."""
        self._record(_MIN_ROWS, _MIN_ROWS)
        self._failures = self._retry_in = 0
        return self.why_not

    def set_capture(self, hidden_layers: tuple[int, ...]) -> None:
        """Record the program again copying out the outputs of decoder layers ``hidden_layers`` every step (an
        EAGLE head reads them); ``()`` copies none."""
        if tuple(hidden_layers) != self.capture:
            self.capture = tuple(hidden_layers)
            self.capacity = 0  # the next step records again

    # -- per step ----------------------------------------------------------------------------------
    @property
    def serves_lora(self) -> bool:
        """Whether steps with adapter rows may run here (the model runner sets their plan first)."""
        return self.lora is not None

    def accepts(self, scheduled) -> bool:
        """Steps whose every sequence takes the native attention (decodes, verification, short prompts)."""
        return all(item.num_new_tokens <= cpu_attention.MAX_Q for item in scheduled)

    def run(self, step) -> torch.Tensor | None:
        """Logits ``[len(logits_indices), V]`` of a step (its packed ``inputs``: a runner ``StepInputs``), or
        None where this step is not one the program runs (the eager forward serves it)."""
        inputs = step.inputs
        meta = inputs.metadata
        native = meta.impl.native_step()  # the step's native store + attention: every sequence native
        rows = inputs.input_ids.shape[1]
        index = inputs.logits_indices
        sampled = index.numel()  # the sampled rows are increasing and distinct: as many as rows is every row
        if native is None or meta.layers.kv_caches is not self.kv_caches or rows > self.max_rows or rows == 0:
            return None
        if not set(step.hidden_layers) <= set(self.capture):
            return None
        plan = None if self.lora is None else self.lora.plan
        if plan is not None and (plan.num_tokens != rows or plan.token_slot is None):
            return None
        if rows > self.capacity or sampled > self.logits_capacity or not self._valid():
            if self._retry_in:  # the last recording failed: eager steps until the next try
                self._retry_in -= 1
                return None
            # a larger step doubles the buffer it overflowed; a re-record for a changed weight keeps the sizes
            grow = lambda need, have: have if need <= have else max(need, min(self.max_rows, max(_MIN_ROWS, 2 * have)))  # noqa: E731
            if not self._record(grow(rows, self.capacity), grow(sampled, self.logits_capacity)):
                return None
        base = self.model.model
        x = self._x[:rows]
        if type(base.embed_tokens) is QuantEmbedding:
            x.copy_(base.embed_tokens(inputs.input_ids[0]))
        else:
            torch.index_select(base.embed_tokens.weight, 0, inputs.input_ids[0], out=x)
        cos, sin = base.rotary_emb(x[None], inputs.position_ids)
        if cos.shape != (1, rows, self.head_dim) or cos.dtype != x.dtype or not cos.is_contiguous() or (
            sin.shape != cos.shape or sin.dtype != x.dtype or not sin.is_contiguous()
        ):
            return None
        self._rows.value = rows
        self._sampled.value = sampled
        self._token_slot.value = None if plan is None else plan.token_slot.data_ptr()
        self._index = None if sampled == rows else index
        self._tokens.value = rows
        self._cos.value, self._sin.value = cos.data_ptr(), sin.data_ptr()
        step_args = native.kernel_args()
        self._slots.value = step_args.slot_mapping
        (self._tables.value, self._table_stride.value, self._lens.value, self._cu.value, self._ids.value,
         self._num_ids.value) = step_args.step
        self._max_q.value = step_args.max_q
        ops, head_op = (self._ops if plan is None else self._lora_ops).pick(rows)
        for i, (fn, args) in enumerate(ops):
            if i == head_op and not sampled:  # no sampled row: no LM head (its gather, if any, still runs)
                continue
            rc = fn(*args)
            if rc:  # the kernels return nonzero when they cannot allocate scratch or meet a slot past the pool
                raise RuntimeError(f"native decode program: {call_list.failed_call(fn)} returned {rc}")
        self.num_runs += 1
        self.num_lora_runs += plan is not None
        for i in step.hidden_layers:  # copies: the buffers are the next step's
            step.hidden[i] = self._caps[i][:rows].clone()
        return self._logits[:sampled]

    def _valid(self) -> bool:
        """Whether the recorded calls still read the model's current weights and settings."""
        return (self.threads == torch.get_num_threads() and self._reads.valid()
                and model_patches.current(self.owner, "packing") is self._packing and not hooks(self._modules))

    # -- recording ---------------------------------------------------------------------------------
    def _record(self, capacity: int, logits_capacity: int) -> bool:
        """Build the call list for up to ``capacity`` rows, ``logits_capacity`` of them sampled; False (and the
        eager path) where it cannot."""
        packing = model_patches.current(self.owner, "packing")
        fused = model_patches.current(self.owner, "fused_layers")
        why = why_not(self.model, fused, packing) or hooks(skipped_modules(self.model))
        if not why:
            try:  # everything is built aside and installed at the end: a failure leaves no half-new program
                self._build(capacity, logits_capacity, packing)
            except Unfit as e:
                why = str(e)
            except Exception as e:  # noqa: BLE001 - out of memory, a packing error: the eager path serves
                why = f"recording failed: {type(e).__name__}: {e}"
        if why:
            self._ops = self._lora_ops = None
            self._keep = []
            self._reads = RecordedReads([], [], [], [])
            self._x = self._r = self._h = self._qkv = self._a = self._o = self._gate_up = self._m = self._logits = None
            self.capacity = self.logits_capacity = 0
            if why != self.why_not:  # said once per reason
                logger.info("native decode program not used now (steps run eagerly): %s", why)
            self.why_not = why
            # the reason may go away (a hook removed, weights back to one dtype): try again, less and less often
            self._failures += 1
            self._retry_in = min(2 ** self._failures, 256)
            return False
        self.why_not = ""
        self._failures = self._retry_in = 0
        self.num_records += 1
        return True

    def _build(self, capacity: int, logits_capacity: int, packing) -> None:
        rec = record(self, capacity, logits_capacity, packing)  # raises Unfit; nothing installed until it returns
        # install (the KV pools stay referenced by the engine; the buffers and packs by the program)
        self._x, self._r, self._h, self._qkv, self._a, self._o, self._gate_up, self._m = rec.buffers
        self._logits, self._caps = rec.logits, rec.caps
        self._ops, self._lora_ops = rec.ops, rec.lora_ops
        self._keep = rec.keep
        self._reads = rec.reads
        self._modules = rec.modules
        self._packing = packing
        self.head_dim, self.threads = rec.head_dim, rec.threads
        self.capacity, self.logits_capacity = capacity, logits_capacity

    def _gather_sampled(self) -> None:
        # the final norm ran on every row: the sampled rows' go to the front, where the LM head reads them
        if self._index is not None:
            self._h[: self._index.shape[0]].copy_(self._h[: self._rows.value].index_select(0, self._index))

    def _final_norm(self) -> None:
        # where the C pass cannot give its bits (fused_ops.rms_norm_exact): as the eager forward, the last
        # residual add, then transformers' own norm module, on the sampled rows only
        n = self._rows.value
        total = torch.add(self._r[:n], self._m[:n], out=self._x[:n])
        if self._index is not None:
            total = total.index_select(0, self._index)
        self._h[: total.shape[0]].copy_(self.model.model.norm(total[None])[0])
