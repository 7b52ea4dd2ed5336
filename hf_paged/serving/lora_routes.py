"""The server's LoRA routes (vLLM's): ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(``{"lora_name", "lora_path"}``), and the adapters' rows of ``/v1/models``. A request's ``model`` field picks an
adapter by name (:class:`~hf_paged.serving.protocol.ServedModel`'s ``lora_modules``).

No ``from __future__ import annotations`` here: FastAPI reads the routes' ``fastapi.Request`` annotations.
"""


import json
import logging
import threading

from hf_paged.lora.request import LoRARequest
from hf_paged.serving.api_error import APIError

logger = logging.getLogger(__name__)


def model_cards(served) -> list[dict]:
    """``/v1/models`` entries of the adapters: ``parent`` is the base model, ``root`` the adapter's folder."""
    return [{"id": name, "object": "model", "created": served.created, "owned_by": "hf_paged", "root": req.lora_path,
             "parent": served.name, "max_model_len": served.max_model_len}
            for name, req in sorted(served.lora_modules.items())]


def install_lora_routes(app, engine, served, check_key, read_body, pool) -> None:
    """Add the load and unload routes to ``app`` (``engine``: the AsyncPagedEngine; ``served``: its ServedModel,
    whose ``lora_modules`` they change; adapters load on one of the request workers, off the event loop)."""
    import fastapi

    lock = threading.Lock()

    def generator():
        inner = engine.engine
        if inner.executor.lora is None:
            raise APIError("this server was started without --enable-lora; LoRA adapters cannot be loaded", 400)
        return inner

    async def fields(request, needed: tuple[str, ...]) -> dict:
        check_key(request)
        try:
            body = json.loads(await read_body(request))
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}", param="body") from e
        if not isinstance(body, dict):
            raise APIError(f"the request body must be a JSON object, got {type(body).__name__}", param="body")
        for key in needed:
            if not isinstance(body.get(key), str) or not body[key]:
                raise APIError(f"{key} must be a non-empty string, got {body.get(key)!r}", param=key)
        return body

    def load(name: str, path: str) -> str:
        inner = generator()
        with lock:
            if name in served.lora_modules or served.accepts(name):
                raise APIError(f"the name {name!r} is already served; unload it first or pick another", 400,
                               param="lora_name")
            used = {r.lora_int_id for r in inner.list_loras()} | {r.lora_int_id for r in served.lora_modules.values()}
            request = LoRARequest(name, max(used, default=0) + 1, path)
            try:
                inner.add_lora(request)
            except ValueError as e:  # the folder's own error: the file and the mismatch
                raise APIError(str(e), 400, param="lora_path") from e
            served.lora_modules[name] = request
        logger.info("LoRA adapter %r loaded from %s", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(name: str) -> str:
        inner = generator()
        with lock:
            request = served.lora_modules.get(name)
            if request is None:
                raise APIError(f"The LoRA adapter {name!r} is not loaded; loaded: {sorted(served.lora_modules)}", 404,
                               param="lora_name", type="not_found_error", code="model_not_found")
            try:
                inner.remove_lora(request.lora_int_id)
            except ValueError as e:  # still in use
                raise APIError(str(e), 400, param="lora_name") from e
            del served.lora_modules[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: fastapi.Request):
        body = await fields(request, ("lora_name", "lora_path"))
        return fastapi.responses.PlainTextResponse(await pool.run(load, body["lora_name"], body["lora_path"]))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: fastapi.Request):
        body = await fields(request, ("lora_name",))
        return fastapi.responses.PlainTextResponse(await pool.run(unload, body["lora_name"]))
