"""The LoRA side of :class:`~hf_paged.engine.generator.PagedGenerator`: adding, removing and listing adapters, and
checking a request's ``lora_request`` (a mixin; the adapters themselves live in the executor's
:class:`~hf_paged.lora.manager.LoRAManager`)."""

from __future__ import annotations

from hf_paged.lora.request import LoRARequest


class LoRAIntake:
    """``add_lora``, ``remove_lora``, ``list_loras`` (vLLM's names) and the per-request check."""

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and register an adapter now (a request naming it later needs no load). Its folder is checked
        against the base model: a bad one raises ValueError naming the file and the mismatch, and the engine
        goes on serving. Returns False if it was already registered."""
        with self._lock:
            self._check_usable()
            return self._lora_manager().add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if it is not registered. Raises ValueError while requests still use it."""
        with self._lock:
            manager = self._lora_manager()
            users = sum(1 for seq in self.scheduler.sequences.values() if seq.lora_int_id == lora_int_id)
            if users:
                raise ValueError(f"LoRA adapter id {lora_int_id} is in use by {users} running or waiting sequences; "
                                 "abort them or let them finish first")
            return manager.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        """The registered adapters."""
        with self._lock:
            return self._lora_manager().list() if self.executor.lora is not None else []

    def _lora_manager(self):
        manager = self.executor.lora
        if manager is None:
            raise ValueError("LoRA adapters need an engine built with enable_lora=True")
        return manager

    def _lora_id(self, lora_request: LoRARequest | None) -> int:
        """The adapter id of a request (0: base); an adapter seen for the first time is loaded and checked now."""
        if lora_request is None:
            return 0
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
        self._lora_manager().add(lora_request)
        return lora_request.lora_int_id
