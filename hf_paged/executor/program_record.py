"""Recording a :class:`~hf_paged.executor.native_program.DecodeProgram`: a model's decode step as its list of native
calls, with what those calls read.

:func:`record` walks the model once: per decoder layer the input norm (with the last layer's residual add), the
q/k/v GEMM and its LoRA deltas, RoPE, the KV store, the paged attention, ``o_proj``, the post-attention norm, the
gate/up GEMM, SiLU-mul and ``down_proj``; then the final norm and the LM head. Every call's arguments are converted
once, over the program's persistent buffers and its per-step pointer cells. Beside the calls it notes what they
read by address or value (parameters, packs, LoRA slots, scalars such as a norm's epsilon), so the program can
check before each replay that the model still is what was recorded (:class:`~hf_paged.executor.program_reads.
RecordedReads`). It raises :class:`Unfit` where the model's current state does not fit; nothing of a failed
recording is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged.executor.program_fit import DTYPES, skipped_modules
from hf_paged.executor.program_ops import CallLists, Copy, Finish, Linear, SiluMul, lora_delta_ops
from hf_paged.executor.program_reads import RecordedReads
from hf_paged.executor.quant_program import QuantEmbedding, QuantLinear, QuantOp, quant_group
from hf_paged.kernels.cpu import attention as cpu_attention, fused_ops
from hf_paged.kernels.cpu.native_gemm import NATIVE_GEMM, NativePackedWeight
from hf_paged.lora.hooks import hook_of as lora_hook
from hf_paged.model.layers.fused_decoder import GATE_UP, QKV
from hf_paged.model.layers.parallel import linear_of


class Unfit(Exception):
    """The model's current state does not fit the program (the eager path serves)."""


def seen(owner: dict, key: str) -> tuple:
    """``(owner, key, obj, version, address)`` of what the program read from ``owner[key]`` (a parameter or a
    submodule): the program checks it is still the same object, a tensor at the same version and address
    (``param.data = t`` keeps the object and its version); version and address None otherwise."""
    obj = owner.get(key)
    if not isinstance(obj, torch.Tensor):
        return owner, key, obj, None, None
    return owner, key, obj, None if obj.is_inference() else obj._version, obj.data_ptr()


def shape(pack) -> tuple[int, int]:
    """``(out, in)`` of a pack: a native group pack (NativePackedWeight.stacked) keeps no concatenated weight."""
    return (pack.out_features, pack.in_features) if type(pack) in (QuantLinear, NativePackedWeight) else tuple(
        pack.source.shape)


@dataclass
class Recording:
    """What :func:`record` made, for the program to install: the step's buffers, the call lists, and what the
    calls hold and read."""

    buffers: tuple  # x, residual, normed, qkv, attention out, o_proj out, gate_up, mlp out
    logits: torch.Tensor
    caps: dict[int, torch.Tensor]
    ops: CallLists  # the base list (no LoRA deltas)
    lora_ops: CallLists  # with the deltas (``ops`` itself when there are none)
    keep: list  # every tensor and pack whose address a call holds
    reads: RecordedReads
    modules: list  # the modules whose hooks the program skips
    head_dim: int
    threads: int


def record(program, capacity: int, logits_capacity: int, packing) -> Recording:
    """The call lists of ``program``'s model for up to ``capacity`` rows, ``logits_capacity`` of them sampled,
    packed linears from ``packing``; raises :class:`Unfit`."""
    return _Recorder(program, packing).build(capacity, logits_capacity)


class _Recorder:
    """One recording: the calls made so far and what they read."""

    def __init__(self, program, packing) -> None:
        self.p, self.packing = program, packing
        self.model, self.base = program.model, program.model.model
        embed = self.base.embed_tokens
        self.dtype = embed.dtype if type(embed) is QuantEmbedding else embed.weight.dtype
        self.dt = DTYPES[self.dtype]
        self.elem = torch.tensor([], dtype=self.dtype).element_size()
        self.threads = torch.get_num_threads()
        self.hidden = embed.embedding_dim
        self.D: int | None = None  # head_dim: build reads it from the first layer once the layers are checked
        gemm = NATIVE_GEMM.load()  # None: no native packs either
        self.norms, self.attn_lib = fused_ops.LIBRARY.load(), cpu_attention.LIBRARY.load()
        if self.norms is None or self.attn_lib is None:
            raise Unfit("the fused-layer or attention C library is not built here")
        self.gemm_fn = None if gemm is None else gemm.hfp_gemm if self.dtype == torch.float32 else gemm.hfp_gemm_bf16
        model, base = self.model, self.base
        # what the calls read by address or value, checked before every replay
        self.seen = [seen(model._modules, "lm_head"), seen(base._modules, "embed_tokens"), seen(base._modules, "norm"),
                     seen(base._modules, "rotary_emb"), seen(base._modules, "layers")]
        self.seen += [seen(base.layers._modules, k) for k in base.layers._modules]
        self.scalars: list = []
        self.groups: list = []
        self.keep: list = []
        self.lora_checks: list = []
        self.deltas: set[int] = set()  # ids of the LoRA delta ops among the calls

    # -- one call (or a few) -------------------------------------------------------------------------
    def delta_op(self, modules, x: torch.Tensor, ys: list[torch.Tensor]) -> list:
        """The LoRA deltas of ``modules`` (one input ``x``, outputs ``ys``): in the LoRA list only."""
        manager = self.p.lora
        slots = [manager.slot_of(m) for m in modules] if manager is not None else []
        targets = [(slot, y) for slot, y in zip(slots, ys) if slot is not None]
        self.seen.extend(seen(slot.__dict__, "a") for slot, _ in targets)  # made, or made again: record again
        self.keep.extend(slot for slot, _ in targets)
        delta = lora_delta_ops(manager, x, targets, self.p._rows, self.p._token_slot, self.threads)
        self.deltas.update(id(op) for op in delta)
        return delta

    def linear_ops(self, module: torch.nn.Module, x: torch.Tensor, x_stride: int, y: torch.Tensor) -> list:
        """A projection's GEMM into ``y`` and its LoRA deltas, then (a tensor-parallel shard's row-parallel layer)
        its all-reduce; the deltas go on the shard's partial sums, as the slot does in its forward."""
        base = linear_of(module)
        ops = [self.gemm_op(*self.pack_of(base), x, x_stride, y)]
        ops += self.delta_op([base], x[:, : base.in_features], [y])
        if base is not module:
            self.seen.append(seen(module._modules, "base"))
            ops.append((Finish(module, y, self.p._rows), ()))
        return ops

    def no_slot(self, *modules: torch.nn.Module) -> None:
        """The delta ops run the manager's slots (none: a plain engine): a layer whose ``lora`` is other than its
        shared LoRA hook runs eagerly (checked per replay). The hook, which another engine's adapter step on the
        same model may set meanwhile, is fine: it adds deltas only in that engine's stepping thread."""
        for module in modules:
            allowed = lora_hook(module)
            current = getattr(module, "lora", None)
            if current is not None and current is not allowed:
                raise Unfit("a LoRA slot the program does not know is set on a linear layer")
            self.lora_checks.append((module, allowed))

    def pack_of(self, module: torch.nn.Linear):
        """A single projection's current pack (packed again if its weight changed), as its forward would."""
        self.no_slot(module)
        if type(module) is QuantLinear:
            self.seen.extend((seen(module._buffers, "qweight"), seen(module._parameters, "bias")))
            self.scalars.append((module, "activations", module.activations))
            return module, module.bias
        pack = None if self.packing is None else self.packing.current_pack(module)
        if pack is None:
            raise Unfit(f"a {type(module).__name__} weight {tuple(module.weight.shape)} is not packed")
        self.seen.extend((seen(module._parameters, "weight"), seen(module._parameters, "bias")))
        self.keep.append(pack)
        return pack, module.bias

    def group_of(self, parent, names):
        """Sibling projections (q/k/v, gate/up) as one pack."""
        self.no_slot(*(getattr(parent, n) for n in names))
        group = quant_group(parent, names)
        if group is not None:  # quantized siblings as one QuantLinear (the members' bytes are views of it)
            self.seen.extend(seen(getattr(parent, n)._buffers, "qweight") for n in names)
            self.scalars.extend((getattr(parent, n), "activations", group.activations) for n in names)
            self.keep.append(group)
            return group, group.bias
        group = None if self.packing is None else self.packing.group(parent, names)
        if group is None:
            raise Unfit(f"{type(parent).__name__} {'/'.join(names)} are not packed as one weight")
        for n in names:  # the members' tensors the pack was made of, and the pack
            params = getattr(parent, n)._parameters
            self.seen.extend((seen(params, "weight"), seen(params, "bias")))
        self.groups.append((group, group.pack))
        return group.pack, group.bias

    def gemm_op(self, pack, bias, x: torch.Tensor, x_stride: int, y: torch.Tensor, rows=None):
        rows = self.p._rows if rows is None else rows
        if type(pack) is QuantLinear:
            return QuantOp(pack, x, x_stride, y, rows, self.threads), ()
        if self.gemm_fn is None or not isinstance(pack, NativePackedWeight) or pack.dtype != self.dtype or (
            self.dtype == torch.bfloat16 and pack.k_even != pack.in_features
        ):  # another packing (oneDNN, MKL, upcast): its own linear, the result copied into the buffer
            return Linear(pack, bias, x, y, rows), ()
        if bias is not None:
            bias = bias.float().contiguous()
            self.keep.append(bias)
        return self.gemm_fn, (x.data_ptr(), x_stride, pack.packed.data_ptr(), None if bias is None else bias.data_ptr(),
                              y.data_ptr(), y.shape[1], rows, pack.out_features, pack.in_features, self.threads)

    def norm_op(self, norm, x, out, residual=None, total=None):
        self.seen.append(seen(norm._parameters, "weight"))
        self.scalars.append((norm, "variance_epsilon", norm.variance_epsilon))
        if norm.weight.dtype != self.dtype or not norm.weight.is_contiguous():
            raise Unfit("an RMSNorm weight of another dtype or layout")
        hidden = self.hidden
        return self.norms.hfp_rms_norm, (
            x.data_ptr(), x.shape[1], 0 if residual is None else residual.data_ptr(), hidden,
            0 if total is None else total.data_ptr(), hidden, norm.weight.data_ptr(), out.data_ptr(), hidden,
            self.p._rows, hidden, float(norm.variance_epsilon), self.dt, fused_ops.torch_sum_lanes(), self.threads,
        )

    # -- the step ------------------------------------------------------------------------------------
    def attention_ops(self, i: int, attn, QKVb, A, widths) -> list:
        """Layer ``i``'s RoPE, KV store and paged attention, from the q/k/v buffer into ``A``."""
        p, D, elem, threads = self.p, self.D, self.elem, self.threads
        q_w, k_w, qkv_w, H, KVH = widths
        paged = p.attention_layers[attn.layer_idx]  # settings learned at start, as the fused layers use
        if paged.softcap is not None:
            raise Unfit("an attention softcap")
        k_cache, v_cache = paged.k_cache, paged.v_cache
        int8_kv = k_cache.dtype == torch.int8  # rows of int8 values and their scale (kernels/kv_quant.py)
        if (k_cache.dtype not in (self.dtype, torch.int8) or v_cache.dtype != k_cache.dtype
                or not k_cache.is_contiguous() or not v_cache.is_contiguous() or v_cache.shape != k_cache.shape
                or H % KVH or tuple(k_cache.shape[2:]) != (KVH, D + 4 if int8_kv else D)):
            raise Unfit(f"layer {i}'s KV pool {tuple(k_cache.shape)} {k_cache.dtype} does not fit {KVH} x {D}")
        k_at, v_at = QKVb.data_ptr() + q_w * elem, QKVb.data_ptr() + (q_w + k_w) * elem
        ops = [(self.norms.hfp_rope, (
            QKVb.data_ptr(), qkv_w, H, k_at, qkv_w, KVH, p._cos, p._sin, D, p._rows, D, self.dt, threads,
        ))]
        if int8_kv:
            ops.append((self.attn_lib.hfp_store_kv_int8, (
                k_at, v_at, qkv_w, qkv_w, k_cache.data_ptr(), v_cache.data_ptr(), p._slots, p._tokens, KVH, D,
                self.dt, k_cache.shape[0] * k_cache.shape[1],
            )))
        else:
            ops.append((self.attn_lib.hfp_store_kv, (
                k_at, v_at, qkv_w * elem, qkv_w * elem, k_cache.data_ptr(), v_cache.data_ptr(), p._slots, p._tokens,
                KVH * D * elem, k_cache.shape[0] * k_cache.shape[1],
            )))
        ops.append((self.attn_lib.hfp_paged_attention, (
            QKVb.data_ptr(), qkv_w, D, k_cache.data_ptr(), v_cache.data_ptr(), p._tables, p._table_stride,
            p._lens, p._cu, p._ids, p._num_ids, A.data_ptr(), q_w, D, H, KVH, D, k_cache.shape[1],
            float(paged.scale), int(paged.sliding_window or 0), 0.0, self.dt,
            cpu_attention.KV_DTYPE_CODES[k_cache.dtype], p._max_q, threads,
        )))
        return ops

    def build(self, capacity: int, logits_capacity: int) -> Recording:
        p, model, base, packing, dtype, hidden = self.p, self.model, self.base, self.packing, self.dtype, self.hidden
        layers = list(base.layers)
        num_hidden = getattr(model.config, "num_hidden_layers", len(layers))
        if len(layers) > num_hidden:  # (fewer: a self:N draft's view, whose forward runs its N layers too)
            raise Unfit("config.num_hidden_layers is less than the number of decoder layers")
        if any(i >= len(layers) for i in p.capture):
            raise Unfit(f"hidden states of layers {p.capture} asked of a model of {len(layers)} layers")
        self.scalars.append((model.config, "num_hidden_layers", num_hidden))
        attn0 = layers[0].self_attn
        self.D = D = attn0.head_dim
        group0 = lambda parent, names: quant_group(parent, names) or (packing and packing.group(parent, names))  # noqa: E731
        qkv0, gu0 = group0(attn0, QKV), group0(layers[0].mlp, GATE_UP)
        if qkv0 is None or gu0 is None:
            raise Unfit("the q/k/v or gate/up projections are not packed as one weight")
        q_w, k_w, v_w = qkv0.sizes
        qkv_w, inter = q_w + k_w + v_w, gu0.sizes[0]
        if q_w % D or k_w % D or k_w != v_w or gu0.sizes[1] != inter:
            raise Unfit(f"projection widths {qkv0.sizes} / {gu0.sizes} do not fit head_dim {D}")
        widths = (q_w, k_w, qkv_w, q_w // D, k_w // D)
        new = lambda width: torch.zeros(capacity, width, dtype=dtype)  # noqa: E731
        X, R, Hn, QKVb, A, O = new(hidden), new(hidden), new(hidden), new(qkv_w), new(q_w), new(hidden)
        GU, M = new(2 * inter), new(hidden)
        logits = torch.zeros(logits_capacity, model.lm_head.out_features, dtype=dtype)
        head = linear_of(model.lm_head)  # a tensor-parallel shard: its vocabulary rows, gathered on rank 0 after
        local = logits if head is model.lm_head else torch.zeros(logits_capacity, head.out_features, dtype=dtype)
        ops: list = []
        caps = {i: new(hidden) for i in p.capture}
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            self.seen += [seen(layer._modules, k)
                          for k in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")]
            self.seen += [seen(attn._modules, k) for k in ("q_proj", "k_proj", "v_proj", "o_proj")]
            self.seen += [seen(mlp._modules, k) for k in ("gate_proj", "up_proj", "down_proj")]
            if i == 0:
                ops.append(self.norm_op(layer.input_layernorm, X, Hn))
            else:  # this layer's input = the last one's residual + its MLP output, added in the norm's pass
                ops.append(self.norm_op(layer.input_layernorm, M, Hn, residual=R, total=X))
                if i - 1 in caps:  # that sum is layer i - 1's output
                    ops.append((Copy(X, caps[i - 1], p._rows), ()))
            if attn.head_dim != D:
                raise Unfit("decoder layers of different head sizes")
            qkv_pack, qkv_bias = self.group_of(attn, QKV)
            if shape(qkv_pack) != (qkv_w, hidden):
                raise Unfit("decoder layers of different projection widths")
            ops.append(self.gemm_op(qkv_pack, qkv_bias, Hn, hidden, QKVb))
            ops += self.delta_op([linear_of(getattr(attn, n)) for n in QKV], Hn,
                                 [QKVb[:, :q_w], QKVb[:, q_w : q_w + k_w], QKVb[:, q_w + k_w :]])
            ops += self.attention_ops(i, attn, QKVb, A, widths)
            ops.extend(self.linear_ops(attn.o_proj, A, q_w, O))
            ops.append(self.norm_op(layer.post_attention_layernorm, O, Hn, residual=X, total=R))
            gu_pack, gu_bias = self.group_of(mlp, GATE_UP)
            if shape(gu_pack) != (2 * inter, hidden):
                raise Unfit("decoder layers of different MLP widths")
            ops.append(self.gemm_op(gu_pack, gu_bias, Hn, hidden, GU))
            ops += self.delta_op([linear_of(getattr(mlp, n)) for n in GATE_UP], Hn, [GU[:, :inter], GU[:, inter:]])
            silu_mul = SiluMul(GU, inter, p._rows, self.threads)  # the fused forward's (C pass or torch's ops)
            ops.append((silu_mul, ()))  # its C call in the joined calls wherever that serves (CallLists)
            ops.extend(self.linear_ops(mlp.down_proj, GU, 2 * inter, M))
        if fused_ops.rms_norm_exact(dtype, hidden):  # the C pass gives the torch module's bits
            ops.append(self.norm_op(base.norm, R, Hn, residual=M, total=X))
            ops.append((p._gather_sampled, ()))
        else:
            ops.append((p._final_norm, ()))
        if len(layers) - 1 in caps:  # the final norm's pass left the last layer's output in X
            ops.append((Copy(X, caps[len(layers) - 1], p._rows), ()))
        head_gemm = self.gemm_op(*self.pack_of(head), Hn, hidden, local, rows=p._sampled)
        ops.append(head_gemm)
        if head is not model.lm_head:  # every rank's rows of the logits to rank 0
            self.seen.append(seen(model.lm_head._modules, "base"))
            ops.append((Finish(model.lm_head, local, p._sampled, out=logits), ()))
        embed = base.embed_tokens
        self.seen.append(seen(embed._buffers if type(embed) is QuantEmbedding else embed._parameters,
                              "qweight" if type(embed) is QuantEmbedding else "weight"))
        head_at = next(i for i, op in enumerate(ops) if op is head_gemm)
        base_ops = [op for op in ops if id(op) not in self.deltas]  # the plain list leaves the LoRA deltas out
        plain = CallLists(base_ops, sum(1 for op in ops[:head_at] if id(op) not in self.deltas))
        return Recording(
            buffers=(X, R, Hn, QKVb, A, O, GU, M), logits=logits, caps=caps, ops=plain,
            lora_ops=CallLists(ops, head_at) if self.deltas else plain, keep=self.keep,
            reads=RecordedReads(self.seen, self.scalars, self.lora_checks, self.groups),
            modules=skipped_modules(model), head_dim=D, threads=self.threads,
        )
