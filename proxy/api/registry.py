"""The model registry of a several-model server: which engine serves a request's ``model``, loaded at
its first request and unloaded when the bound or the idle time says so.

States of a model (llama.cpp's router names them so in ``GET /v1/models``): ``unloaded`` ->
``loading`` -> ``loaded``, or ``failed`` with its one-line reason: requests get that reason at once for
:data:`LOAD_RETRY_S` seconds (a client retrying a broken model must not unload the working ones for
each try), after which a request tries again; ``POST /models/load`` tries again at once. Rules:

- concurrent first requests load a model once (they await the same task);
- ``models_max`` (``--models-max``, 0: no bound): before a load, the least recently used loaded model
  with no request in flight is unloaded; while every loaded model has requests in flight the load
  waits for one to finish (llama.cpp's router and Ollama's scheduler wait so too);
- ``budget_bytes`` (``--models-memory-bytes``, 0: no check): the same, until the loaded models'
  estimates (``proxy.model_memory.estimate_bytes``) and the new one's fit; a model whose estimate alone
  exceeds it is refused (503 ``model_memory_budget``) rather than swapping the machine;
- ``model_ttl_s`` (``--model-ttl-s``, 0: never): a loaded model idle that long is unloaded;
- a model is *in flight* from the moment a request names it until its response has ended (the
  app's ``InFlight`` middleware releases it), so neither rule unloads under a running stream.

Loads and unloads run off the event loop (the engine factory on a thread of its own, the engine core
in a child process unless ``--no-engine-process``), and each is one log line with its time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.catalog import ModelEntry
from proxy.engine.client import EmbeddingClient, EngineClient
from proxy.errors import ModelNotFoundError, ServiceUnavailableError
from proxy.media.fetch import MediaPolicy
from proxy.pipeline import ModelFeatures
from proxy.settings import Settings

log = logging.getLogger("proxy.api")

Loaded = tuple[EngineClient | None, EmbeddingClient | None]
LoadFn = Callable[["ModelSlot"], Awaitable[Loaded]]
UnloadFn = Callable[["ModelSlot"], Awaitable[None]]
WAIT_POLL_S = 0.05
"""Seconds between two looks at the in-flight counts while a load or an unload waits for them."""
LOAD_RETRY_S = 30.0
"""Seconds a failed load answers its requests with its reason before a request may try it again."""


def _size(num_bytes: int) -> str:
    if num_bytes >= 1 << 30:
        return f"{num_bytes / (1 << 30):.2f} GiB"
    return f"{num_bytes >> 20} MiB" if num_bytes >= 1 << 20 else f"{num_bytes} bytes"


@dataclass(eq=False)
class ModelSlot:
    """One known model and, while loaded, its engine.

    Attributes:
        entry: the catalog row (id, path, aliases, options, kind).
        settings: the settings its engine runs with (``proxy.catalog.entry_settings``).
        status: ``unloaded``, ``loading``, ``loaded`` or ``failed``.
        client: its engine client while loaded (None for an embedding-only model).
        embedder: its ``/v1/embeddings`` client while loaded.
        features: what its chat template supports (read at load).
        error: why its last load failed (one line, no path), for ``failed``.
        error_code: the ``code`` its requests get then (``model_load_failed``, or a refusal's own).
        in_flight: requests that named it and have not ended.
        last_used: ``time.monotonic()`` of the last request's start or end.
        failed_at: ``time.monotonic()`` of its last failed load.
        size_bytes: its estimated host memory, counted against the budget.
        admitted: a load under way has passed the bound and the budget (it counts against them;
            one still waiting for room does not, or two waiting loads would wait for each other).
    """

    entry: ModelEntry
    settings: Settings
    size_bytes: int = 0
    admitted: bool = False
    status: str = "unloaded"
    client: EngineClient | None = None
    embedder: EmbeddingClient | None = None
    features: ModelFeatures = field(default_factory=ModelFeatures)
    error: str | None = None
    error_code: str = "model_load_failed"
    in_flight: int = 0
    last_used: float = 0.0
    failed_at: float = 0.0
    task: asyncio.Task[None] | None = None

    @property
    def id(self) -> str:
        return self.entry.id

    def acquire(self) -> None:
        """A request names this model (pair with :meth:`release` when its response has ended)."""
        self.in_flight += 1
        self.last_used = time.monotonic()

    def release(self) -> None:
        self.in_flight -= 1
        self.last_used = time.monotonic()


class ModelRegistry:
    """Every known model by id and alias, and the load / unload rules of the module docstring.

    Args:
        entries: the catalog, in order.
        settings_of: an entry -> the settings its engine runs with.
        load: builds and starts a slot's clients (awaited on the event loop; raises on failure).
        unload: shuts a slot's clients down.
        reason_of: a load failure -> the one-line reason requests and ``/v1/models`` show.
        size_of: a model's settings -> its estimated bytes (for ``budget_bytes``).
    """

    def __init__(self, entries: tuple[ModelEntry, ...], settings_of: Callable[[ModelEntry], Settings],
                 load: LoadFn, unload: UnloadFn, reason_of: Callable[[BaseException, ModelSlot], str],
                 *, models_max: int = 0, ttl_s: float = 0.0, budget_bytes: int = 0,
                 size_of: Callable[[Settings], int] = lambda s: 0) -> None:
        self.slots = [ModelSlot(e, s, size_of(s)) for e, s in ((e, settings_of(e)) for e in entries)]
        self.budget_bytes = budget_bytes
        self._by_name = {name: slot for slot in self.slots for name in slot.entry.names}
        self._load, self._unload, self._reason_of = load, unload, reason_of
        self.models_max, self.ttl_s = models_max, ttl_s
        self._lock = asyncio.Lock()  # one eviction decision at a time
        self._ttl_task: asyncio.Task[None] | None = None
        self.before_serving: asyncio.Future[None] | None = None
        """Work a load awaits before its model serves (the server's read-ahead of the models' files,
        ``proxy.api.multi.start_read_ahead``: it holds the interpreter lock, so no stream may run
        beside it)."""

    def find(self, name: str) -> ModelSlot:
        """The slot named ``name`` (its id or an alias).

        Raises:
            ModelNotFoundError: no such model (404 ``model_not_found``, as OpenAI answers).
        """
        slot = self._by_name.get(name)
        if slot is None:
            raise ModelNotFoundError(f"The model '{name}' does not exist; GET /v1/models lists the models "
                                     "served here.", param="model")
        return slot

    def loaded(self) -> list[ModelSlot]:
        return [s for s in self.slots if s.status == "loaded"]

    # ---- load ------------------------------------------------------------------------------------

    async def ensure_loaded(self, slot: ModelSlot, retry: bool = False) -> ModelSlot:
        """``slot`` once loaded: loads it, or awaits the load already running (once for everyone). A
        load that failed less than :data:`LOAD_RETRY_S` ago is not tried again unless ``retry``.

        Raises:
            ServiceUnavailableError: the load failed (503 with its one-line reason).
        """
        recent = slot.status == "failed" and time.monotonic() - slot.failed_at < LOAD_RETRY_S
        if slot.status != "loaded" and not (recent and not retry):
            if slot.task is None or slot.task.done():
                slot.task = asyncio.create_task(self._run_load(slot))
            await asyncio.shield(slot.task)
        if slot.status != "loaded":
            if slot.error_code != "model_load_failed":  # a refusal says it in its own words
                raise ServiceUnavailableError(slot.error or "", code=slot.error_code)
            raise ServiceUnavailableError(f"The model '{slot.id}' failed to load: {slot.error}",
                                          code="model_load_failed")
        return slot

    async def _run_load(self, slot: ModelSlot) -> None:
        slot.status, slot.error, slot.error_code = "loading", None, "model_load_failed"
        slot.admitted = False
        try:
            await self._make_room(slot)
            slot.admitted = True
            start = time.monotonic()
            slot.client, slot.embedder = await self._load(slot)
            if self.before_serving is not None:
                await asyncio.shield(self.before_serving)
        except Exception as exc:
            slot.status, slot.error = "failed", self._reason_of(exc, slot)
            slot.failed_at = time.monotonic()
            refused = isinstance(exc, ServiceUnavailableError) and exc.code is not None
            slot.error_code = str(getattr(exc, "code", "")) if refused else "model_load_failed"
            log.error("model '%s' failed to load: %s", slot.id, slot.error)
            log.debug("load failure of '%s'", slot.id, exc_info=True)
            return
        if slot.client is not None:
            slot.features = ModelFeatures.detect(
                slot.client.tokenizer, slot.settings.tool_call_parser, slot.settings.reasoning_parser,
                accepts_images=slot.client.vision is not None, media=MediaPolicy.from_settings(slot.settings))
        slot.status, slot.last_used = "loaded", time.monotonic()
        log.info("model '%s' loaded in %.1f s (%d loaded)", slot.id, time.monotonic() - start,
                 len(self.loaded()))

    async def _make_room(self, slot: ModelSlot) -> None:
        """Unload least recently used idle models until ``slot`` fits under ``models_max`` and the
        memory budget; waits while every loaded one has requests in flight.

        Raises:
            ServiceUnavailableError: ``slot``'s estimate alone exceeds the budget (``model_memory_budget``).
        """
        budget = self.budget_bytes
        if budget and slot.size_bytes > budget:
            parts = ("weights, KV cache and engine process" if slot.settings.engine_process
                     else "weights and KV cache")
            raise ServiceUnavailableError(
                f"The model '{slot.id}' needs about {_size(slot.size_bytes)} ({parts}), more "
                f"than the {_size(budget)} the loaded models may take (--models-memory-bytes).",
                code="model_memory_budget")
        if not self.models_max and not budget:
            return
        async with self._lock:
            while True:
                others = [s for s in self.slots if s is not slot and (
                    s.status == "loaded" or (s.status == "loading" and s.admitted))]
                fits = not budget or sum(s.size_bytes for s in others) + slot.size_bytes <= budget
                if fits and (not self.models_max or len(others) < self.models_max):
                    return
                idle = [s for s in others if s.status == "loaded" and s.in_flight == 0]
                if idle:
                    await self.unload(min(idle, key=lambda s: s.last_used), "least recently used")
                else:
                    await asyncio.sleep(WAIT_POLL_S)

    # ---- unload ----------------------------------------------------------------------------------

    async def unload(self, slot: ModelSlot, why: str) -> None:
        """Unload ``slot`` once its requests in flight have ended (a no-op when it is not loaded);
        a load under way is awaited first. The log line gives the unload's own time and, when it
        waited, how long."""
        asked = time.monotonic()
        if slot.status == "loading" and slot.task is not None:
            await asyncio.shield(slot.task)
        while slot.status == "loaded" and slot.in_flight > 0:
            await asyncio.sleep(WAIT_POLL_S)
        if slot.status != "loaded":
            if slot.status == "failed":
                slot.status, slot.error = "unloaded", None
            return
        slot.status = "unloaded"
        start = time.monotonic()
        try:
            await self._unload(slot)
        finally:
            slot.client, slot.embedder, slot.features = None, None, ModelFeatures()
        waited = f"; after {start - asked:.1f} s waiting for its load or requests in flight" \
            if start - asked >= 0.05 else ""
        log.info("model '%s' unloaded in %.1f s (%s%s)", slot.id, time.monotonic() - start, why, waited)

    def start(self) -> None:
        """Start the idle-unload loop (``model_ttl_s``); call on the event loop."""
        if self.ttl_s > 0:
            self._ttl_task = asyncio.create_task(self._ttl_loop())

    async def _ttl_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.ttl_s / 4))
            now = time.monotonic()
            for slot in self.loaded():
                if slot.in_flight == 0 and now - slot.last_used >= self.ttl_s:
                    try:
                        await self.unload(slot, f"idle {now - slot.last_used:.0f} s")
                    except Exception:  # the loop goes on for the other models
                        log.exception("unloading model '%s' failed", slot.id)

    async def close(self) -> None:
        """Stop the idle loop and unload every model (the server's end)."""
        if self._ttl_task is not None:
            self._ttl_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ttl_task
        for slot in self.slots:
            if slot.task is not None and not slot.task.done():
                slot.task.cancel()
            if slot.status == "loaded":
                slot.in_flight = 0
                await self.unload(slot, "server stopped")

    # ---- views -----------------------------------------------------------------------------------

    def status_of(self, slot: ModelSlot) -> dict[str, Any]:
        """llama.cpp router's ``status`` object: ``{"value": state}``, plus ``"failed": true`` and
        the reason of a failed load."""
        if slot.status == "failed":
            return {"value": "unloaded", "failed": True, "reason": slot.error}
        return {"value": slot.status}
