"""ServerState: the server's life cycle (``loading`` -> ``ready`` | ``failed`` -> ``draining`` ->
``stopped``).

Shutdown (``begin_drain``, called when uvicorn starts its graceful shutdown): new requests get
503, running ones may finish within ``shutdown_grace_s``; then every open response is ended with
an error (``code: "server_shutdown"``) and its engine requests are aborted. On a several-model
server a request that came before the shutdown and waits for its model's load is one of the running
ones (uvicorn's graceful shutdown lets the requests it accepted finish): it is served if the model
is ready within the grace period, else ended with that error when the grace period ends
(:meth:`ServerState.grace_over`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxy import protocol
from proxy.engine.client import EmbeddingClient, EngineClient
from proxy.errors import InvalidRequestError, ServiceUnavailableError
from proxy.media.fetch import MediaPolicy
from proxy.pipeline import ModelFeatures
from proxy.settings import Settings

from .faults import FaultInjector
from .responses_api.store import ResponseStore

if TYPE_CHECKING:
    from starlette.requests import Request

    from proxy.metrics import ServerMetrics

    from .registry import ModelRegistry

log = logging.getLogger("proxy.api")

SHUTDOWN_MESSAGE = "The server is shutting down; the response was cut short. Retry the request."
SLOT_KEY = "streamproxy.model"
"""The request scope's key of the registry slot that serves it (``proxy.api.on_demand``)."""
LOADING_RETRY_AFTER_S = (5, 60)
"""Bounds (seconds) of the ``Retry-After`` of a 503 while the model loads (:func:`loading_retry_after_s`):
60 is the most every version of the OpenAI and Anthropic SDKs waits for (later ones wait longer)."""


def loading_retry_after_s(elapsed_s: float) -> int:
    """The ``Retry-After`` (whole seconds) of a 503 while a load that has run ``elapsed_s`` seconds goes
    on: as long again, within :data:`LOADING_RETRY_AFTER_S`. The SDKs retry twice by default, each
    after the ``Retry-After`` they get, so a client that asks t seconds into a load waits for it until
    about 4t (a cached start of the default model takes 8-11 s, a first one with its conversion and
    compile 90 s: ``docs/bench/2026-12-06-several-models.md``)."""
    low, high = LOADING_RETRY_AFTER_S
    return int(min(high, max(low, math.ceil(elapsed_s))))


@dataclass(frozen=True)
class ServedModel:
    """The engine that serves one request and what its chat template supports."""

    client: EngineClient
    features: ModelFeatures


class ServerState:
    """What the routes share: settings, the engine client once loaded, the drain state.

    Attributes:
        status: ``"loading"``, ``"ready"``, ``"failed"`` or ``"stopped"`` (draining is
            :attr:`is_draining`).
        client: the :class:`~proxy.engine.client.EngineClient` once loaded (started).
        features: what the served model's chat template supports (read once, when it is ready).
        responses_store: stored Responses API responses (``previous_response_id``), in memory.
        load_error: why loading failed, for ``/health``.
        fault_injector: the test-only fault hook, when enabled.
        embedder: the :class:`~proxy.engine.client.EmbeddingClient` of ``/v1/embeddings`` once loaded.
        registry: the several-model server's models (``proxy.api.registry``), or None.
        server_metrics: the several-model server's own metrics (``proxy.metrics.ServerMetrics``).
        loading_since: ``time.monotonic()`` at the server's start, when the one model began to load
            (a 503's ``Retry-After`` while it loads: :meth:`still_loading`).
    """

    def __init__(self, settings: Settings, fault_injector: FaultInjector | None = None) -> None:
        self.settings = settings
        self.status = "loading"
        self.client: EngineClient | None = None
        self.features = ModelFeatures()
        self.responses_store = ResponseStore(settings.responses_store_max_entries,
                                             settings.responses_store_max_bytes)
        self.load_error: str | None = None
        self.is_draining = False
        self.fault_injector = fault_injector
        self.embedder: EmbeddingClient | None = None
        self.registry: ModelRegistry | None = None
        self.server_metrics: ServerMetrics | None = None
        self._grace_timer: asyncio.TimerHandle | None = None
        self._grace_over: asyncio.Event | None = None
        self.loading_since = time.monotonic()

    def set_ready(self, client: EngineClient) -> None:
        """The model is loaded and its engine started: serve it (its features are read now)."""
        settings = self.settings
        self.features = ModelFeatures.detect(client.tokenizer, settings.tool_call_parser,
                                             settings.reasoning_parser,
                                             accepts_images=client.vision is not None,
                                             media=MediaPolicy.from_settings(settings))
        if self.features.reasoning_parser is not None:
            how = ("detected from the chat template" if self.features.reasoning_detected
                   else "--reasoning-parser")
            log.info("reasoning parser: %s (%s; --reasoning-parser none turns it off)",
                     self.features.reasoning_parser, how)
        store = self.responses_store
        client.metrics.watch_responses_store(lambda: len(store), lambda: store.num_bytes)
        self.client, self.status = client, "ready"

    def set_failed(self, message: str) -> None:
        self.status, self.load_error = "failed", message

    @property
    def is_healthy(self) -> bool:
        """Ready, not draining, and the engine runs (``/health`` 200); with several models: not
        draining (a model that failed to load fails only its own requests)."""
        if self.registry is not None:
            return self.status == "ready" and not self.is_draining
        return (self.status == "ready" and not self.is_draining and self.client is not None
                and self.client.is_healthy)

    @property
    def max_n(self) -> int:
        """Most choices (``n``) per request."""
        return max(1, min(self.settings.max_num_seqs, 128))

    def require_ready(self) -> EngineClient:
        """The engine client, or 503 while loading / draining / after a failed load.

        (A dead engine is reported by ``EngineClient.generate``: ``EngineDeadError``, 503.)

        Raises:
            ServiceUnavailableError: ``server_shutdown`` while draining, ``service_unavailable``
                while loading or after a failed load.
            InvalidRequestError: a several-model server, for an endpoint that names no model (the
                SGLang worker-info endpoints, which describe one model).
        """
        self.check_not_draining()
        if self.registry is not None:
            raise InvalidRequestError("This server serves several models and this endpoint names none; "
                                      "GET /v1/models lists them.")
        if self.status == "loading":
            raise self.still_loading("The model is still loading; retry shortly.")
        if self.client is None or self.status != "ready":
            raise ServiceUnavailableError("The model failed to load; see the server log.")
        return self.client

    def still_loading(self, message: str) -> ServiceUnavailableError:
        """The 503 of a request that came while the model loads, with its ``Retry-After``
        (:func:`loading_retry_after_s` of the time since :attr:`loading_since`)."""
        return ServiceUnavailableError(message, retry_after_s=loading_retry_after_s(
            time.monotonic() - self.loading_since))

    def check_not_draining(self) -> None:
        """Raises ServiceUnavailableError (``server_shutdown``) while the server drains."""
        if self.is_draining:
            raise ServiceUnavailableError("The server is shutting down; send the request to another replica.",
                                          code="server_shutdown")

    def model_of(self, request: Request) -> ServedModel:
        """The engine serving ``request``: the one model's (:meth:`require_ready`), or on a
        several-model server the loaded model its ``model`` named (``proxy.api.on_demand``).

        Raises:
            ServiceUnavailableError: as :meth:`require_ready`; the model was unloaded meanwhile; the
                shutdown's grace period has ended (``server_shutdown``).
            InvalidRequestError: the model is an embedding model (it generates nothing).
        """
        slot = request.scope.get(SLOT_KEY)
        if self.registry is None or slot is None:
            return ServedModel(self.require_ready(), self.features)
        self.check_grace()  # admitted before any shutdown (on_demand): served until the grace ends
        if slot.status == "loaded" and slot.client is None:
            raise InvalidRequestError(f"The model '{slot.id}' is an embedding model: use "
                                      "POST /v1/embeddings.", param="model")
        if slot.client is None:  # unloaded between its load and now: a retry loads it again
            raise ServiceUnavailableError(f"The model '{slot.id}' is not loaded; retry.", retry_after_s=1)
        return ServedModel(slot.client, slot.features)

    # ---- embeddings (POST /v1/embeddings, proxy.api.embeddings) ----------------------------------

    def require_embedder(self, request: Request | None = None) -> EmbeddingClient:
        """The embedding client (on a several-model server: of the model ``request`` names), or 503 as
        :meth:`require_ready`."""
        slot = request.scope.get(SLOT_KEY) if request is not None else None
        if self.registry is not None and slot is not None:
            self.check_grace()
            if slot.embedder is None:
                raise ServiceUnavailableError(f"The model '{slot.id}' is not loaded; retry.", retry_after_s=1)
            embedder: EmbeddingClient = slot.embedder
            return embedder
        self.require_ready()
        if self.embedder is None:
            raise self.still_loading("The embedding model is still loading; retry shortly.")
        return self.embedder

    def extra_model_cards(self) -> list[dict[str, Any]]:
        """``/v1/models`` entries beside the chat model's: the embedding model's, when it is served
        under its own id (``routes.list_models`` appends these)."""
        embedder, client = self.embedder, self.client
        chat_name = client.model.served_model_name if client is not None else None
        if embedder is None or embedder.served_model_name == chat_name:
            return []
        return [protocol.model_card(embedder.served_model_name, embedder.created, embedder.max_model_len)]

    # ---- shutdown ---------------------------------------------------------------------------------

    def begin_drain(self, grace_s: float | None = None) -> None:
        """Start the graceful shutdown (idempotent; call on the event loop).

        From now on new completions get 503 and ``/health`` says ``draining`` (503), so a load
        balancer takes this replica out. Responses already running may finish for ``grace_s``
        seconds (default ``settings.shutdown_grace_s``); then :meth:`end_streams` cuts the rest.
        """
        if self.is_draining:
            return
        self.is_draining = True
        for client in self.clients():
            client.begin_drain()  # an engine process that dies now is not restarted
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        log.info("shutting down: no new requests; open responses get %.1f s to finish", grace)
        self._grace_timer = asyncio.get_running_loop().call_later(max(0.0, grace), self.end_streams)

    def grace_over(self) -> asyncio.Event:
        """Set when the shutdown's grace period has ended (:meth:`end_streams`); call on the loop."""
        if self._grace_over is None:
            self._grace_over = asyncio.Event()
        return self._grace_over

    def check_grace(self) -> None:
        """Raises ServiceUnavailableError (``server_shutdown``, the cut responses' error) once the
        shutdown's grace period has ended: a request admitted before the shutdown runs until then."""
        if self._grace_over is not None and self._grace_over.is_set():
            raise ServiceUnavailableError(SHUTDOWN_MESSAGE, code="server_shutdown")

    def end_streams(self) -> int:
        """End every open response now: SSE error event (``server_shutdown``) + ``[DONE]``, or a
        503 JSON error for a non-stream request; their engine requests are aborted, and requests
        still waiting for a model's load end with that error (:meth:`grace_over`). Returns how
        many engine requests were ended."""
        self.grace_over().set()
        n = sum(client.abort_all(SHUTDOWN_MESSAGE, "server_shutdown") for client in self.clients())
        if n:
            log.warning("shutdown grace period over: ended %d running request(s)", n)
        return n

    def clients(self) -> list[EngineClient]:
        """Every loaded engine client (the one model's, or each loaded model's)."""
        if self.registry is not None:
            return [s.client for s in self.registry.loaded() if s.client is not None]
        return [self.client] if self.client is not None else []

    def cancel_drain_timer(self) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
