"""``LoRAManager``: the engine's adapters: registered, loaded in host memory (an LRU), resident in slots.

- registered: every adapter added (``add``) and not removed; a request names one by its ``lora_int_id``.
- host memory: the checked weights of at most ``max_cpu_loras`` adapters, least recently used dropped first
  (an evicted adapter is read from its folder again when a step needs it).
- slots: at most ``max_loras`` adapters copied into every adapted linear's stacked tensors
  (:class:`~hf_paged.lora.slots.LoRASlot`); the scheduler admits at most that many distinct adapters at
  once, so one step never needs more.

Per step the model runner calls :meth:`set_step` with each scheduled sequence's adapter and token count (the
layers the step's adapters adapt then carry their shared hook, :mod:`hf_paged.lora.hooks`, which runs this
manager's slots in this thread; the slots read :attr:`plan`), runs the forward, then :meth:`clear_step`. Several
managers (engines) on one model share the layers and their hooks, each stepping in its own thread if need be.
A decode bucket (static buffers, CUDA graphs) wraps its replay in :meth:`begin_static_step` and
:meth:`end_static_step`: the rows' slots go into its static index buffer, and every linear with adapter tensors
carries its hook for that replay.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping

import torch

from hf_paged.lora.hooks import LayerHook, current_manager, hook_of, set_current_manager
from hf_paged.lora.loading import LoRALayerWeights, LoRAWeights, load_lora
from hf_paged.lora.request import LoRARequest
from hf_paged.lora.slots import LoRASlot, StepPlan, plan_step

logger = logging.getLogger(__name__)


class LoRAManager:
    """The adapters of one engine.

    Args:
        linears: The base model's adaptable linears: module name -> module (``in_features``,
            ``out_features`` and a float weight, whose device and dtype the slots take).
        max_loras: Adapters resident at once (distinct adapters one step may mix).
        max_lora_rank: The largest rank an adapter may have.
        max_cpu_loras: Adapters whose weights stay in host memory (>= ``max_loras``); None: ``max_loras``.
        parts: On a tensor-parallel rank, each sharded linear's part of the full layer: module name ->
            ``(dim, start, stop, full)``, its output rows (dim 0: column-parallel) or input columns (dim 1:
            row-parallel) ``[start, stop)`` of ``full``. Adapters are checked against the full layers and cut like
            them: a column-parallel layer's slot keeps B's rows ``[start, stop)`` (A whole), a row-parallel one's
            keeps A's columns (B whole). A row-parallel slot's delta is then this rank's partial sum, added before
            the layer's all-reduce, so the reduced output holds the adapter's delta once.
    """

    def __init__(self, linears: Mapping[str, torch.nn.Module], max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None = None,
                 parts: Mapping[str, tuple[int, int, int, int]] | None = None) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        self.parts = {name: part for name, part in (parts or {}).items() if name in linears}
        self.targets = {name: _full_shape(m, self.parts.get(name)) for name, m in linears.items()}
        self.slots: dict[str, LoRASlot] = {}
        for name, module in linears.items():
            weight = _float_weight(module)
            self.slots[name] = LoRASlot(self, module.in_features, module.out_features, max_loras, max_lora_rank,
                                        weight.device, weight.dtype)
        self.requests: dict[int, LoRARequest] = {}
        self._host: OrderedDict[int, LoRAWeights] = OrderedDict()
        self._resident: list[int | None] = [None] * max_loras  # slot -> adapter id
        self._slot_use: list[int] = [0] * max_loras  # the step that last used each slot (LRU among slots)
        self._slot_names: list[set[str]] = [set() for _ in range(max_loras)]  # the layers each slot's adapter adapts
        self._steps = 0
        self.plan: StepPlan | None = None
        self.kernel_backend = "auto"  # the per-token kernels' backend (hf_paged.kernels.lora)
        self.per_token: bool | None = None  # eager steps' plans per token (kernels); None: on CUDA only
        self._static_entered: list = []  # hooks put on by begin_static_step only
        self._layers: dict[str, torch.nn.Module] = {}  # the engine layers whose ``lora`` a step sets (bind)
        self._hooks: dict[str, LayerHook] = {}  # their shared hooks (one per layer, whatever the engines)
        self._entered: list[LayerHook] = []  # the hooks this step put on their layers
        self._previous = None  # the thread's current manager before this step (restored after)
        self._slot_by_layer: dict[int, LoRASlot] = {}
        self._slot_by_hook: dict[int, tuple[LayerHook, LoRASlot]] = {}
        self._hook_by_layer: dict[int, tuple[torch.nn.Module, LayerHook]] = {}

    # -- adapters -------------------------------------------------------------------------------------
    def add(self, request: LoRARequest) -> bool:
        """Register and load ``request`` (checked now: a bad folder raises ValueError naming the file and the
        mismatch, and nothing changes). False if this adapter is already registered."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"expected a LoRARequest, got {type(request).__name__}")
        known = self.requests.get(request.lora_int_id)
        if known is not None:
            if known != request:
                raise ValueError(f"lora_int_id {request.lora_int_id} is already the adapter {known.lora_name!r} "
                                 f"({known.lora_path}); remove it first or use another id")
            return False
        same_name = next((r for r in self.requests.values() if r.lora_name == request.lora_name), None)
        if same_name is not None:
            raise ValueError(f"an adapter named {request.lora_name!r} is already loaded (lora_int_id "
                             f"{same_name.lora_int_id})")
        weights = load_lora(request, self.targets, self.max_lora_rank)
        self.requests[request.lora_int_id] = request
        self._keep(weights)
        logger.info("LoRA adapter %r (id %d) loaded: %d linears, rank <= %d", request.lora_name,
                    request.lora_int_id, len(weights.layers), weights.max_rank)
        return True

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter (its slot is freed); False if it is not registered. Requests still running with
        it must be finished first (the engine checks)."""
        if self.requests.pop(lora_id, None) is None:
            return False
        self._host.pop(lora_id, None)
        if lora_id in self._resident:
            slot = self._resident.index(lora_id)
            self._resident[slot] = None
            self._slot_names[slot] = set()
            for layer in self.slots.values():
                layer.set(slot, None)
        return True

    def list(self) -> list[LoRARequest]:
        return list(self.requests.values())

    def _keep(self, weights: LoRAWeights) -> None:
        lora_id = weights.request.lora_int_id
        self._host[lora_id] = weights
        self._host.move_to_end(lora_id)
        while len(self._host) > self.max_cpu_loras:
            dropped, _ = self._host.popitem(last=False)
            logger.debug("LoRA adapter id %d dropped from host memory (max_cpu_loras=%d)", dropped, self.max_cpu_loras)

    def _weights(self, lora_id: int) -> LoRAWeights:
        weights = self._host.get(lora_id)
        if weights is None:  # dropped from the host LRU: read its folder again
            weights = load_lora(self.requests[lora_id], self.targets, self.max_lora_rank)
        self._keep(weights)
        return weights

    # -- the step -------------------------------------------------------------------------------------
    def set_step(self, rows: list[tuple[int, int]], device: torch.device) -> None:
        """Make the step's adapters resident and plan its rows: ``rows`` lists, in batch order, each scheduled
        sequence's adapter id (0: base) and number of tokens."""
        ids = {lora_id for lora_id, _ in rows if lora_id}
        if not ids:
            self.plan = None
            return
        if len(ids) > self.max_loras:
            raise RuntimeError(f"a step mixes {len(ids)} adapters, more than max_loras={self.max_loras} (the "
                               "scheduler admits at most that many: a bug, please report)")
        unknown = sorted(i for i in ids if i not in self.requests)
        if unknown:
            raise RuntimeError(f"LoRA adapter id(s) {unknown} were removed while requests still use them")
        self._steps += 1
        slot_of = {lora_id: self._make_resident(lora_id, ids) for lora_id in sorted(ids)}
        token_slots: list[int] = []
        for lora_id, n in rows:
            token_slots.extend([slot_of[lora_id] if lora_id else -1] * n)
        self._leave()  # (a step set twice without clear_step: the hooks of the first come off)
        self.plan = plan_step(token_slots, device, self.per_token, self.kernel_backend)
        # the layers this step's adapters adapt get their shared hook, which runs this manager's slot in this
        # thread only (other engines on the model may step in other threads meanwhile); off after the forward
        self._previous = set_current_manager(self)
        names = set().union(*(self._slot_names[slot] for slot in slot_of.values()))
        for name in sorted(names):
            hook = self._hooks.get(name)
            if hook is not None:
                hook.enter()
                self._entered.append(hook)

    def clear_step(self) -> None:
        """After the step's forward: no plan, this step's hooks off the layers (unless another engine's step
        still needs them)."""
        self.plan = None
        self._leave()

    def _leave(self) -> None:
        self._leave_static()
        for hook in self._entered:
            hook.leave()
        if self._entered or current_manager() is self:
            set_current_manager(self._previous)
            self._previous = None
        self._entered.clear()

    @property
    def generation(self) -> int:
        """How many linears have adapter tensors. They are made once (when an adapter of the linear first
        becomes resident) and then only written in place, so a graph captured at this generation runs every
        delta it ever will need to until the next linear gets its tensors."""
        return sum(slot.a is not None for slot in self.slots.values())

    def begin_static_step(self, index: torch.Tensor) -> StepPlan:
        """Run the current step's adapter rows from ``index`` (a decode bucket's static int32 buffer, its padded
        row count long): the rows' slots are copied in, padding rows get ``-1``, and the plan becomes a static
        ``"tokens"`` plan over every linear that has adapter tensors (each carries its hook for the replay: a
        captured graph then holds every one's kernels, whichever adapters later steps mix). Returns the step's
        own plan, for :meth:`end_static_step`."""
        plan = self.plan
        n = len(plan.token_slots)
        if n > index.numel():
            raise ValueError(f"a static LoRA index of {index.numel()} rows cannot hold the step's {n} rows")
        index[:n].copy_(torch.tensor(plan.token_slots, dtype=index.dtype), non_blocking=True)
        index[n:].fill_(-1)
        self.plan = StepPlan(index.numel(), "tokens", plan.segments, token_slots=plan.token_slots,
                             token_index=index, static=True, backend=self.kernel_backend)
        if index.device.type == "cpu" and index.dtype == torch.int32:  # the CPU kernel reads it as it is
            self.plan.token_slot = index
        entered = {id(hook) for hook in self._entered}
        for name, hook in self._hooks.items():
            if self.slots[name].a is not None and id(hook) not in entered:
                hook.enter()
                self._static_entered.append(hook)
        return plan

    def end_static_step(self, plan: StepPlan) -> None:
        """Undo :meth:`begin_static_step`: the step's own plan back (an eager forward may still serve the step),
        the extra hooks off their layers (unless another engine's step needs them)."""
        self.plan = plan
        self._leave_static()

    def _leave_static(self) -> None:
        for hook in self._static_entered:
            hook.leave()
        self._static_entered.clear()

    def bind(self, layers: dict[str, torch.nn.Module]) -> None:
        """The layer objects whose ``lora`` :meth:`set_step` sets (:func:`~hf_paged.lora.attach.attach_slots`),
        through each layer's one :class:`~hf_paged.lora.hooks.LayerHook` (shared with other engines' managers)."""
        self._layers = {name: layer for name, layer in layers.items() if name in self.slots}
        self._hooks = {name: hook_of(layer) for name, layer in self._layers.items()}
        self._slot_by_layer = {id(layer): self.slots[name] for name, layer in self._layers.items()}
        # keyed by id, the object kept beside it: a lookup is one dict get and one identity check
        self._slot_by_hook = {id(hook): (hook, self.slots[name]) for name, hook in self._hooks.items()}
        self._hook_by_layer = {id(layer): (layer, self._hooks[name]) for name, layer in self._layers.items()}

    def slot_of_hook(self, hook: LayerHook) -> LoRASlot | None:
        """This manager's slot for the layer of ``hook`` (None: a layer it does not adapt)."""
        entry = self._slot_by_hook.get(id(hook))
        return entry[1] if entry is not None and entry[0] is hook else None

    def hook_of(self, layer: torch.nn.Module) -> LayerHook | None:
        """What a step sets as ``layer.lora`` (its shared hook), or None where this manager does not bind it:
        the native decode program accepts a layer whose ``lora`` is None or this."""
        entry = self._hook_by_layer.get(id(layer))
        return entry[1] if entry is not None and entry[0] is layer else None

    def slot_of(self, layer: torch.nn.Module) -> LoRASlot | None:
        """This manager's slot for the bound layer object ``layer`` (None: not one it adapts); the native decode
        program runs it from its delta ops."""
        slot = self._slot_by_layer.get(id(layer))
        return slot if slot is not None and any(m is layer for m in self._layers.values()) else None

    def _make_resident(self, lora_id: int, needed: set[int]) -> int:
        if lora_id in self._resident:
            slot = self._resident.index(lora_id)
        else:
            free = [s for s, held in enumerate(self._resident) if held is None or held not in needed]
            slot = min(free, key=lambda s: (self._resident[s] is not None, self._slot_use[s]))
            weights = self._weights(lora_id)
            for name, layer in self.slots.items():
                layer.set(slot, _local(weights.layers.get(name), self.parts.get(name)))
            self._resident[slot] = lora_id
            self._slot_names[slot] = set(weights.layers)
        self._slot_use[slot] = self._steps
        return slot


def _full_shape(module: torch.nn.Module, part: tuple[int, int, int, int] | None) -> tuple[int, int]:
    """``(in_features, out_features)`` of the full layer ``module`` is (a part of, on a tensor-parallel rank)."""
    if part is None:
        return module.in_features, module.out_features
    dim, _, _, full = part
    return (module.in_features, full) if dim == 0 else (full, module.out_features)


def _local(weights: LoRALayerWeights | None, part: tuple[int, int, int, int] | None) -> LoRALayerWeights | None:
    """This rank's cut of one layer's adapter weights: B's output rows for a column-parallel part (dim 0), A's
    input columns for a row-parallel one (dim 1); the whole weights where the layer is whole."""
    if weights is None or part is None:
        return weights
    dim, start, stop, _ = part
    if dim == 0:
        return LoRALayerWeights(weights.a, weights.b[start:stop], weights.scale)
    return LoRALayerWeights(weights.a[:, start:stop], weights.b, weights.scale)


def _float_weight(module: torch.nn.Module) -> torch.Tensor:
    """The weight whose device and dtype the module's slots take (a quantized linear: float32 on its device)."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight
    param = next(module.parameters(), None) if hasattr(module, "parameters") else None
    device = param.device if param is not None else torch.device("cpu")
    return torch.empty(0, device=device, dtype=torch.float32)
