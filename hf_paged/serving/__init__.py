"""Serving: the background engine loop (:class:`AsyncPagedEngine`), the OpenAI-compatible server
(``hf_paged.serving.server``, needs ``pip install hf-paged[serve]``) and its Prometheus metrics."""

from hf_paged.serving.engine_loop import (
    AsyncPagedEngine, EngineClosedError, EngineFailedError, QueueFullError, StepInfo,
)
from hf_paged.serving.stream import RequestStream

__all__ = ["AsyncPagedEngine", "EngineClosedError", "EngineFailedError", "QueueFullError", "RequestStream", "StepInfo"]
