"""``PagedGenerator``'s watch on its model's weights: cached KV (the prefix cache, decode graphs' inputs) was
computed with the weights of its time, so a changed weight (a training step, ``load_state_dict``, a replaced
tensor) drops it before a prefix hit could serve the old model's KV. A mixin: it uses the engine's ``model``,
``executor``, ``kv_manager``, ``scheduler`` and ``_weights_seen``."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class WeightWatch:
    """Drops the prefix cache and decode graphs when the model's weights changed (see the module docstring)."""

    def _weights_version(self) -> int:
        # Inference tensors keep no version counter: only their replacement (a new object or storage) is seen.
        # The address catches ``param.data = t``, which keeps the object and its version.
        params = list(self.model.parameters())
        return sum(p._version for p in params if not p.is_inference()) + hash(tuple((id(p), p.data_ptr()) for p in params))

    def _drop_stale_prefix_cache(self) -> None:
        """Cached KV was computed with the weights of its time: forget it when a weight changed (a training
        step, ``load_state_dict``), or a prefix hit would serve the old model's KV.

        Only a step that can admit a waiting request looks the prefix cache up, so without decode graphs the
        check (a walk over every parameter, ~0.5 ms on the default model) runs only when requests wait.
        """
        if not self.executor.watches_weights and (not self.kv_manager.enable_prefix_caching or not self.scheduler.waiting):
            return
        version = self._weights_version()
        if version != self._weights_seen:
            if self._weights_seen is not None:
                logger.info("model weights changed: dropping the prefix cache and decode graphs")
                self.kv_manager.reset_prefix_cache()
                self.executor.weights_changed()
            self._weights_seen = version
