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
from hf_paged.model.layers.fused_decoder import GATE_UP, QKV
from hf_paged.executor.program_fit import DTYPES
from hf_paged.executor.program_fit import hooks, skipped_modules, why_not
from hf_paged.kernels.cpu import attention as cpu_attention, call_list, fused_ops
from hf_paged.kernels.cpu.native_gemm import NATIVE_GEMM, NativePackedWeight
from hf_paged.executor.quant_program import QuantEmbedding, QuantLinear, QuantOp, quant_group
from hf_paged.model.layers.parallel import linear_of
from hf_paged.executor.program_reads import RecordedReads
from hf_paged.executor.program_ops import CallLists, Copy as _Copy, Finish as _Finish, Linear as _Linear, SiluMul as _SiluMul
from hf_paged.executor.program_ops import lora_delta_ops
from hf_paged.lora.hooks import hook_of as lora_hook

logger = logging.getLogger(__name__)

_MIN_ROWS = 16


def _seen(owner: dict, key: str) -> tuple:
    """``(owner, key, obj, version, address)`` of what the program read from ``owner[key]`` (a parameter or a
    submodule): :meth:`DecodeProgram._valid` checks it is still the same object, a tensor at the same version
    and address (``param.data = t`` keeps the object and its version); version and address None otherwise."""
    obj = owner.get(key)
    if not isinstance(obj, torch.Tensor):
        return owner, key, obj, None, None
    return owner, key, obj, None if obj.is_inference() else obj._version, obj.data_ptr()


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
            except _Unfit as e:
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
        model, base = self.model, self.model.model
        layers = list(base.layers)
        num_hidden = getattr(model.config, "num_hidden_layers", len(layers))
        if len(layers) > num_hidden:  # (fewer: a self:N draft's view, whose forward runs its N layers too)
            raise _Unfit("config.num_hidden_layers is less than the number of decoder layers")
        if any(i >= len(layers) for i in self.capture):
            raise _Unfit(f"hidden states of layers {self.capture} asked of a model of {len(layers)} layers")
        embed = base.embed_tokens
        dtype = embed.dtype if type(embed) is QuantEmbedding else embed.weight.dtype
        dt = DTYPES[dtype]
        elem = torch.tensor([], dtype=dtype).element_size()
        threads = torch.get_num_threads()
        attn0 = layers[0].self_attn
        D = attn0.head_dim
        hidden = embed.embedding_dim
        gemm = NATIVE_GEMM.load()  # None: no native packs either
        norms, attn_lib = fused_ops.LIBRARY.load(), cpu_attention.LIBRARY.load()
        if norms is None or attn_lib is None:
            raise _Unfit("the fused-layer or attention C library is not built here")
        gemm_fn = None if gemm is None else gemm.hfp_gemm if dtype == torch.float32 else gemm.hfp_gemm_bf16
        # what the calls read by address or value, checked before every replay
        seen = [_seen(model._modules, "lm_head"), _seen(base._modules, "embed_tokens"), _seen(base._modules, "norm"),
                _seen(base._modules, "rotary_emb"), _seen(base._modules, "layers")]
        seen += [_seen(base.layers._modules, k) for k in base.layers._modules]
        scalars = [(model.config, "num_hidden_layers", num_hidden)]
        groups, keep = [], []  # keep: every tensor and pack whose address a call holds
        lora_checks, deltas = [], set()  # deltas: ids of the LoRA delta ops in ``ops``
        manager = self.lora

        def delta_op(modules, x: torch.Tensor, ys: list[torch.Tensor]) -> list:
            # the LoRA deltas of ``modules`` (one input ``x``, outputs ``ys``): in the LoRA list only
            slots = [manager.slot_of(m) for m in modules] if manager is not None else []
            targets = [(slot, y) for slot, y in zip(slots, ys) if slot is not None]
            seen.extend(_seen(slot.__dict__, "a") for slot, _ in targets)  # made, or made again: record again
            keep.extend(slot for slot, _ in targets)
            delta = lora_delta_ops(manager, x, targets, self._rows, self._token_slot, threads)
            deltas.update(id(op) for op in delta)
            return delta

        def linear_ops(module: torch.nn.Module, x: torch.Tensor, x_stride: int, y: torch.Tensor) -> list:
            # a projection's GEMM into ``y`` and its LoRA deltas, then (a tensor-parallel shard's row-parallel
            # layer) its all-reduce; the deltas go on the shard's partial sums, as the slot does in its forward
            base = linear_of(module)
            ops = [gemm_op(*pack_of(base), x, x_stride, y)]
            ops += delta_op([base], x[:, : base.in_features], [y])
            if base is not module:
                seen.append(_seen(module._modules, "base"))
                ops.append((_Finish(module, y, self._rows), ()))
            return ops

        def no_slot(*modules: torch.nn.Module) -> None:
            # the delta ops run the manager's slots (none: a plain engine): a layer whose ``lora`` is other than its
            # shared LoRA hook runs eagerly (checked per replay). The hook, which another engine's adapter step on
            # the same model may set meanwhile, is fine: it adds deltas only in that engine's stepping thread
            for module in modules:
                allowed = lora_hook(module)
                current = getattr(module, "lora", None)
                if current is not None and current is not allowed:
                    raise _Unfit("a LoRA slot the program does not know is set on a linear layer")
                lora_checks.append((module, allowed))

        def pack_of(module: torch.nn.Linear):
            # a single projection's current pack (packed again if its weight changed), as its forward would
            no_slot(module)
            if type(module) is QuantLinear:
                seen.extend((_seen(module._buffers, "qweight"), _seen(module._parameters, "bias")))
                scalars.append((module, "activations", module.activations))
                return module, module.bias
            pack = None if packing is None else packing.current_pack(module)
            if pack is None:
                raise _Unfit(f"a {type(module).__name__} weight {tuple(module.weight.shape)} is not packed")
            seen.extend((_seen(module._parameters, "weight"), _seen(module._parameters, "bias")))
            keep.append(pack)
            return pack, module.bias

        def group_of(parent, names):
            no_slot(*(getattr(parent, n) for n in names))
            group = quant_group(parent, names)
            if group is not None:  # quantized siblings as one QuantLinear (the members' bytes are views of it)
                seen.extend(_seen(getattr(parent, n)._buffers, "qweight") for n in names)
                scalars.extend((getattr(parent, n), "activations", group.activations) for n in names)
                keep.append(group)
                return group, group.bias
            group = None if packing is None else packing.group(parent, names)
            if group is None:
                raise _Unfit(f"{type(parent).__name__} {'/'.join(names)} are not packed as one weight")
            for n in names:  # the members' tensors the pack was made of, and the pack
                params = getattr(parent, n)._parameters
                seen.extend((_seen(params, "weight"), _seen(params, "bias")))
            groups.append((group, group.pack))
            return group.pack, group.bias

        def gemm_op(pack, bias, x: torch.Tensor, x_stride: int, y: torch.Tensor, rows=self._rows):
            if type(pack) is QuantLinear:
                return QuantOp(pack, x, x_stride, y, rows, threads), ()
            if gemm_fn is None or not isinstance(pack, NativePackedWeight) or pack.dtype != dtype or (
                dtype == torch.bfloat16 and pack.k_even != pack.in_features
            ):  # another packing (oneDNN, MKL, upcast): its own linear, the result copied into the buffer
                return _Linear(pack, bias, x, y, rows), ()
            if bias is not None:
                bias = bias.float().contiguous()
                keep.append(bias)
            return gemm_fn, (x.data_ptr(), x_stride, pack.packed.data_ptr(), None if bias is None else bias.data_ptr(),
                             y.data_ptr(), y.shape[1], rows, pack.out_features, pack.in_features, threads)

        def norm_op(norm, x, out, residual=None, total=None):
            seen.append(_seen(norm._parameters, "weight"))
            scalars.append((norm, "variance_epsilon", norm.variance_epsilon))
            if norm.weight.dtype != dtype or not norm.weight.is_contiguous():
                raise _Unfit("an RMSNorm weight of another dtype or layout")
            return norms.hfp_rms_norm, (
                x.data_ptr(), x.shape[1], 0 if residual is None else residual.data_ptr(), hidden,
                0 if total is None else total.data_ptr(), hidden, norm.weight.data_ptr(), out.data_ptr(), hidden,
                self._rows, hidden, float(norm.variance_epsilon), dt, fused_ops.torch_sum_lanes(), threads,
            )

        group0 = lambda parent, names: quant_group(parent, names) or (packing and packing.group(parent, names))  # noqa: E731
        qkv0, gu0 = group0(attn0, QKV), group0(layers[0].mlp, GATE_UP)
        if qkv0 is None or gu0 is None:
            raise _Unfit("the q/k/v or gate/up projections are not packed as one weight")
        q_w, k_w, v_w = qkv0.sizes
        qkv_w, inter = q_w + k_w + v_w, gu0.sizes[0]
        if q_w % D or k_w % D or k_w != v_w or gu0.sizes[1] != inter:
            raise _Unfit(f"projection widths {qkv0.sizes} / {gu0.sizes} do not fit head_dim {D}")
        H, KVH = q_w // D, k_w // D
        new = lambda width: torch.zeros(capacity, width, dtype=dtype)  # noqa: E731
        X, R, Hn, QKVb, A, O = new(hidden), new(hidden), new(hidden), new(qkv_w), new(q_w), new(hidden)
        GU, M = new(2 * inter), new(hidden)
        logits = torch.zeros(logits_capacity, model.lm_head.out_features, dtype=dtype)
        head = linear_of(model.lm_head)  # a tensor-parallel shard: its vocabulary rows, gathered on rank 0 after
        local = logits if head is model.lm_head else torch.zeros(logits_capacity, head.out_features, dtype=dtype)
        ops: list = []
        caps = {i: new(hidden) for i in self.capture}
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            seen += [_seen(layer._modules, k) for k in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")]
            seen += [_seen(attn._modules, k) for k in ("q_proj", "k_proj", "v_proj", "o_proj")]
            seen += [_seen(mlp._modules, k) for k in ("gate_proj", "up_proj", "down_proj")]
            if attn.head_dim != D:
                raise _Unfit("decoder layers of different head sizes")
            paged = self.attention_layers[attn.layer_idx]  # settings learned at start, as the fused layers use
            if paged.softcap is not None:
                raise _Unfit("an attention softcap")
            k_cache, v_cache = paged.k_cache, paged.v_cache
            int8_kv = k_cache.dtype == torch.int8  # rows of int8 values and their scale (kernels/kv_quant.py)
            if (k_cache.dtype not in (dtype, torch.int8) or v_cache.dtype != k_cache.dtype or not k_cache.is_contiguous()
                    or not v_cache.is_contiguous() or v_cache.shape != k_cache.shape or H % KVH
                    or tuple(k_cache.shape[2:]) != (KVH, D + 4 if int8_kv else D)):
                raise _Unfit(f"layer {i}'s KV pool {tuple(k_cache.shape)} {k_cache.dtype} does not fit {KVH} x {D}")
            if i == 0:
                ops.append(norm_op(layer.input_layernorm, X, Hn))
            else:  # this layer's input = the last one's residual + its MLP output, added in the norm's pass
                ops.append(norm_op(layer.input_layernorm, M, Hn, residual=R, total=X))
                if i - 1 in caps:  # that sum is layer i - 1's output
                    ops.append((_Copy(X, caps[i - 1], self._rows), ()))
            qkv_pack, qkv_bias = group_of(attn, QKV)
            if _shape(qkv_pack) != (qkv_w, hidden):
                raise _Unfit("decoder layers of different projection widths")
            ops.append(gemm_op(qkv_pack, qkv_bias, Hn, hidden, QKVb))
            ops += delta_op([linear_of(getattr(attn, n)) for n in QKV], Hn,
                            [QKVb[:, :q_w], QKVb[:, q_w : q_w + k_w], QKVb[:, q_w + k_w :]])
            ops.append((norms.hfp_rope, (
                QKVb.data_ptr(), qkv_w, H, QKVb.data_ptr() + q_w * elem, qkv_w, KVH, self._cos, self._sin, D,
                self._rows, D, dt, threads,
            )))
            if int8_kv:
                ops.append((attn_lib.hfp_store_kv_int8, (
                    QKVb.data_ptr() + q_w * elem, QKVb.data_ptr() + (q_w + k_w) * elem, qkv_w, qkv_w,
                    k_cache.data_ptr(), v_cache.data_ptr(), self._slots, self._tokens, KVH, D, dt,
                    k_cache.shape[0] * k_cache.shape[1],
                )))
            else:
                ops.append((attn_lib.hfp_store_kv, (
                    QKVb.data_ptr() + q_w * elem, QKVb.data_ptr() + (q_w + k_w) * elem, qkv_w * elem, qkv_w * elem,
                    k_cache.data_ptr(), v_cache.data_ptr(), self._slots, self._tokens, KVH * D * elem,
                    k_cache.shape[0] * k_cache.shape[1],
                )))
            ops.append((attn_lib.hfp_paged_attention, (
                QKVb.data_ptr(), qkv_w, D, k_cache.data_ptr(), v_cache.data_ptr(), self._tables, self._table_stride,
                self._lens, self._cu, self._ids, self._num_ids, A.data_ptr(), q_w, D, H, KVH, D, k_cache.shape[1],
                float(paged.scale), int(paged.sliding_window or 0), 0.0, dt, cpu_attention.KV_DTYPE_CODES[k_cache.dtype],
                self._max_q, threads,
            )))
            ops.extend(linear_ops(attn.o_proj, A, q_w, O))
            ops.append(norm_op(layer.post_attention_layernorm, O, Hn, residual=X, total=R))
            gu_pack, gu_bias = group_of(mlp, GATE_UP)
            if _shape(gu_pack) != (2 * inter, hidden):
                raise _Unfit("decoder layers of different MLP widths")
            ops.append(gemm_op(gu_pack, gu_bias, Hn, hidden, GU))
            ops += delta_op([linear_of(getattr(mlp, n)) for n in GATE_UP], Hn, [GU[:, :inter], GU[:, inter:]])
            silu_mul = _SiluMul(GU, inter, self._rows, threads)  # the fused forward's (C pass or torch's ops)
            ops.append((silu_mul, ()))  # its C call in the joined calls wherever that serves (CallLists)
            ops.extend(linear_ops(mlp.down_proj, GU, 2 * inter, M))
        final = base.norm
        if fused_ops.rms_norm_exact(dtype, hidden):  # the C pass gives the torch module's bits
            ops.append(norm_op(final, R, Hn, residual=M, total=X))
            ops.append((self._gather_sampled, ()))
        else:
            ops.append((self._final_norm, ()))
        if len(layers) - 1 in caps:  # the final norm's pass left the last layer's output in X
            ops.append((_Copy(X, caps[len(layers) - 1], self._rows), ()))
        head_gemm = gemm_op(*pack_of(head), Hn, hidden, local, rows=self._sampled)
        ops.append(head_gemm)
        if head is not model.lm_head:  # every rank's rows of the logits to rank 0
            seen.append(_seen(model.lm_head._modules, "base"))
            ops.append((_Finish(model.lm_head, local, self._sampled, out=logits), ()))
        seen.append(_seen(embed._buffers if type(embed) is QuantEmbedding else embed._parameters,
                          "qweight" if type(embed) is QuantEmbedding else "weight"))
        # -- all built: install (the KV pools stay referenced by the engine; the buffers and packs by the program)
        self._x, self._r, self._h, self._qkv, self._a, self._o, self._gate_up, self._m = X, R, Hn, QKVb, A, O, GU, M
        self._logits, self._caps = logits, caps
        head_at = next(i for i, op in enumerate(ops) if op is head_gemm)
        base_ops = [op for op in ops if id(op) not in deltas]  # the plain list leaves the LoRA deltas out
        self._ops = CallLists(base_ops, sum(1 for op in ops[:head_at] if id(op) not in deltas))
        self._lora_ops = CallLists(ops, head_at) if deltas else self._ops
        self._keep = keep
        self._reads = RecordedReads(seen, scalars, lora_checks, groups)
        self._modules = skipped_modules(model)
        self._packing = packing
        self.head_dim, self.threads = D, threads
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


def _shape(pack) -> tuple[int, int]:
    # a native group pack (NativePackedWeight.stacked) keeps no concatenated weight: its sizes say the shape
    return (pack.out_features, pack.in_features) if type(pack) in (QuantLinear, NativePackedWeight) else tuple(
        pack.source.shape)


class _Unfit(Exception):
    """The model's current state does not fit the program (the eager path serves)."""

