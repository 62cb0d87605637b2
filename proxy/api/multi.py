"""A several-model server's assembly and its model endpoints.

- :func:`build_registry`: the :class:`~proxy.api.registry.ModelRegistry` of the catalog, whose loads
  run the engine factory on a thread of its own (the engine core itself in a child process unless
  ``--no-engine-process``) and whose unloads shut the engine down off the event loop.
- ``GET /v1/models`` and ``GET /v1/models/{id}``: every known model with llama.cpp router's
  ``"status": {"value": "loaded" | "loading" | "unloaded"}`` (a failed load: ``"failed": true`` and
  its ``"reason"``) and its ``aliases``.
- ``POST /models/load`` and ``POST /models/unload`` (llama.cpp router's paths, body ``{"model": id}``):
  idempotent, unlike llama.cpp's (loading a loaded model or unloading an unloaded one is a 200
  ``{"success": true}``); an unload waits for the model's requests in flight to end.
- :func:`load_failure_reason`: one line naming the model, never a file path or a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from proxy import protocol
from proxy.catalog import ModelEntry, entry_settings
from proxy.engine.client import EmbeddingClient, EngineClient, ModelInfo
from proxy.errors import InvalidRequestError, StreamproxyError
from proxy.metrics import ServerMetrics
from proxy.model_memory import estimate_bytes, memory_budget
from proxy.settings import Settings
from proxy.threads import start_in_own_thread

from .body import read_json_body
from .on_demand import until_loaded
from .registry import Loaded, ModelRegistry, ModelSlot
from .responses import json_response
from .state import ServerState

log = logging.getLogger("proxy.api")
EngineFactory = Callable[[Settings], EngineClient]
EmbeddingFactory = Callable[[Settings, ModelInfo], EmbeddingClient]
REASON_MAX_CHARS = 300
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:])(?:~|/)[^\s'\"]*/[^\s'\",;:)]*")


def load_failure_reason(exc: BaseException, model_id: str, path: str | None, *,
                        hide_paths: bool = True) -> str:
    """``exc`` as one line for clients and ``/health``: its first line, the model's path replaced by
    its id and any other absolute path by ``<path>`` (transformers' errors name absolute paths),
    at most ``REASON_MAX_CHARS`` characters. ``hide_paths`` False: the paths stay (the server's own
    log and terminal, where the user gave them)."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    if hide_paths and path:
        for p in sorted({path, str(Path(path).expanduser()), str(Path(path).expanduser().resolve())}, key=len,
                        reverse=True):
            line = line.replace(p, f"<{model_id}>")
    if hide_paths:
        line = _ABSOLUTE_PATH.sub("<path>", line)
    return line if len(line) <= REASON_MAX_CHARS else line[: REASON_MAX_CHARS - 3] + "..."


def start_read_ahead(registry: ModelRegistry) -> asyncio.Future[None]:
    """Start ``proxy.engine.factory.read_model_files_ahead`` of the chat models on a thread of its own
    (call on the event loop); the registry's loads await it before their model serves
    (``ModelRegistry.before_serving``), so it never runs beside a stream. It overlaps the first
    load's engine process instead of delaying ``/health``. A failure is logged (each model's files
    are then read at its load)."""
    models = [slot.settings for slot in registry.slots if slot.entry.kind == "generate"]

    def read(models: list[Settings]) -> None:
        from proxy.engine.factory import read_model_files_ahead

        try:
            read_model_files_ahead(models)
        except Exception:  # the loads read what is missing
            log.exception("reading the models' tokenizers ahead failed; each is read at its load")

    return asyncio.wrap_future(start_in_own_thread(read, models, name="streamproxy-load"))


async def _off_loop(fn: Callable[[Settings], Any], settings: Settings) -> Any:
    return await asyncio.wrap_future(start_in_own_thread(fn, settings, name="streamproxy-load"))


LOAD_RESERVED_CORES = 1  # CPU cores the serving engines leave to a model loading beside them
RESERVE_WAIT_S = 2.0  # the longest a load waits for the engines to apply it (one step each)


def build_registry(settings: Settings, entries: tuple[ModelEntry, ...], state: ServerState,
                   factory: EngineFactory, embed_factory: EmbeddingFactory,
                   yielding_factory: EngineFactory | None = None) -> ModelRegistry:
    """The registry of ``entries`` (``proxy.catalog.build_catalog``) with ``settings``' bounds. A model
    loads with ``yielding_factory`` (a load at a lower priority: ``proxy.api.app.on_demand_engine_factory``)
    when another model is loaded (it serves, and the load must not stall it), else with ``factory``
    (nothing of this server to yield to: a load at the server's priority is not slowed by the
    machine's other work). While such a load runs, every loaded model steps with
    ``LOAD_RESERVED_CORES`` fewer CPU threads (``EngineClient.reserve_cores``): a load at idle
    priority gets only the cores the serving engines leave, and a 2-thread step on 2 cores leaves
    none (``docs/bench/2026-12-06-load-reserve.md``)."""
    registry: ModelRegistry | None = None
    yielding_loads = 0  # loads with yielding_factory under way

    def serving_clients() -> list[EngineClient]:
        slots = registry.slots if registry is not None else ()
        return [o.client for o in slots if o.status == "loaded" and o.client is not None]

    def reserve(cores: int) -> None:
        for client in serving_clients():
            client.reserve_cores(cores)

    async def reserved() -> None:  # each engine applies it at its next turn (after a step)
        deadline = time.monotonic() + RESERVE_WAIT_S
        while not all(c.cores_reserved() for c in serving_clients()) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def load(slot: ModelSlot) -> Loaded:
        nonlocal yielding_loads
        s = slot.settings
        if slot.entry.kind == "embedding":  # served by /v1/embeddings only, loaded now
            return None, await _off_loop(lambda s: embed_factory(s, ModelInfo("", 0)), s)
        serving = registry is not None and any(o is not slot and o.status == "loaded" for o in registry.slots)
        if not (serving and yielding_factory):
            client = await _off_loop(factory, s)
        else:
            yielding_loads += 1
            reserve(LOAD_RESERVED_CORES)
            try:
                # the load starts once the engines step with fewer threads: a 2-thread step whose
                # two threads the load's start put on one core was 50-80 ms longer
                await reserved()
                client = await _off_loop(yielding_factory, s)
            finally:
                yielding_loads -= 1
                if yielding_loads == 0:
                    reserve(0)
        client.start()
        if yielding_loads:  # another load still runs: this model leaves it a core as the others do
            client.reserve_cores(LOAD_RESERVED_CORES)
        if state.fault_injector is not None:
            client.fault_injector = state.fault_injector
        try:
            embedder = await _off_loop(lambda s: embed_factory(s, client.model), s)
        except BaseException:
            client.shutdown()
            raise
        return client, embedder

    async def unload(slot: ModelSlot) -> None:
        client, embedder = slot.client, slot.embedder

        def stop(_: Settings) -> None:
            if client is not None:
                client.shutdown()
            if embedder is not None:
                embedder.shutdown()

        await _off_loop(stop, slot.settings)

    def reason_of(exc: BaseException, slot: ModelSlot) -> str:
        if isinstance(exc, StreamproxyError):  # a refusal of ours (the memory budget): its own words
            return exc.message
        return f"{type(exc).__name__}: {load_failure_reason(exc, slot.id, slot.entry.path)}"

    registry = ModelRegistry(entries, lambda e: entry_settings(settings, e), load, unload, reason_of,
                             models_max=settings.models_max, ttl_s=settings.model_ttl_s,
                             budget_bytes=memory_budget(settings), size_of=estimate_bytes)
    return registry


def server_metrics(state: ServerState) -> ServerMetrics:
    """The several-model server's own ``/metrics`` (``proxy.metrics.ServerMetrics``): every known
    model's state and the Responses API store's size, shown also while no model is loaded."""
    registry, store = state.registry, state.responses_store
    assert registry is not None
    return ServerMetrics(lambda: [(slot.id, slot.status) for slot in registry.slots],
                         lambda: len(store), lambda: store.num_bytes)


def _registry(request: Request) -> ModelRegistry:
    registry: ModelRegistry | None = request.app.state.server.registry
    assert registry is not None  # these routes are mounted only with a registry
    return registry


def model_card(registry: ModelRegistry, slot: ModelSlot) -> dict[str, Any]:
    """One ``/v1/models`` entry: OpenAI's model object, what is served when loaded, its status."""
    client, embedder = slot.client, slot.embedder
    if client is not None:
        info = client.model
        card = protocol.model_card(slot.id, info.created, info.max_model_len, dtype=info.dtype,
                                   quantization=info.quantization)
    elif embedder is not None:
        card = protocol.model_card(slot.id, embedder.created, embedder.max_model_len)
    else:
        card = protocol.model_card(slot.id, 0)
    card["status"] = registry.status_of(slot)
    card["aliases"] = list(slot.entry.aliases)
    if slot.entry.kind != "generate":
        card["kind"] = slot.entry.kind
    return card


def list_models(request: Request) -> Response:
    """``GET /v1/models`` of a several-model server: every known model, in catalog order."""
    registry = _registry(request)
    return json_response({"object": "list", "data": [model_card(registry, s) for s in registry.slots]})


def get_model(request: Request) -> Response:
    """``GET /v1/models/{model_id}`` (an id or an alias); 404 ``model_not_found`` for another."""
    registry = _registry(request)
    return json_response(model_card(registry, registry.find(request.path_params.get("model_id", ""))))


async def _named(request: Request) -> ModelSlot:
    state: ServerState = request.app.state.server
    body = await read_json_body(request, state.settings.max_body_bytes)
    name = body.get("model")
    if not isinstance(name, str):
        raise InvalidRequestError("'model' (a model id) is required.", param="model")
    return _registry(request).find(name)


async def load_model(request: Request) -> Response:
    """``POST /models/load`` ``{"model": id}``: load it (200 once loaded, also when it was); a failed
    load is the 503 of its reason."""
    slot = await _named(request)
    request.app.state.server.check_not_draining()
    await until_loaded(request.app.state.server, slot, retry=True)
    return json_response({"success": True, "model": slot.id, "status": _registry(request).status_of(slot)})


async def unload_model(request: Request) -> Response:
    """``POST /models/unload`` ``{"model": id}``: unload it once its requests have ended (200, also
    when it was not loaded)."""
    slot = await _named(request)
    await _registry(request).unload(slot, "POST /models/unload")
    return json_response({"success": True, "model": slot.id, "status": _registry(request).status_of(slot)})


def health_models(registry: ModelRegistry) -> list[dict[str, Any]]:
    """``/health``'s per-model states: ``{"id", "status"}`` (``loaded``, ``loading``, ``unloaded``,
    ``failed``), a failed load's ``error``, and a loaded engine's ``num_running`` / ``num_waiting``
    (``status`` ``dead`` when its engine has died)."""
    out = []
    for slot in registry.slots:
        row: dict[str, Any] = {"id": slot.id, "status": slot.status}
        if slot.error:
            row["error"] = slot.error
        client = slot.client
        if client is not None and slot.status == "loaded":
            stats = client.stats()
            row["num_running"], row["num_waiting"] = stats.num_running, stats.num_waiting
            if not client.is_healthy:
                row["status"] = "dead"
        out.append(row)
    return out
