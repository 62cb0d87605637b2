"""Routing a request to its model's engine on a several-model server, loading it first when needed.

:func:`on_demand` wraps an endpoint: it reads the body, finds the model ``model`` names
(``ModelRegistry.find``: its id or an alias; absent: a 400 naming ``model``; unknown: a 404
``model_not_found``), writes the model's id into the body (so every later check and the response name
it so, as OpenAI answers an alias with the model's own id), holds the model in flight until the
response has ended (:class:`InFlight`), and loads it when it is not loaded. A stream that must wait
for the load gets its headers and a ``: keepalive`` comment at once and one every
``--keepalive-interval-s`` until the load is done (the comments a stream sends while it waits in the
queue), then the endpoint's own events; a load that fails ends it with the endpoint's error event.
A non-stream request waits for the load and gets the endpoint's answer, or the load's 503. A
request that waits for a load when the shutdown's grace period ends gets the ``server_shutdown``
error then (``ServerState.grace_over``; it is served if its model is ready before).

A request without ``model`` is served by the one model when there is only one (vLLM and llama.cpp's
server do the same; OpenAI requires the field): on a one-model server (no registry) the body gets the
served id of the model the endpoint serves (:func:`sole_model_id`) and the endpoint runs as it always
has; on a several-model server with one entry, that entry.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.errors import InvalidRequestError, StreamproxyError

from .body import BODY_KEY, read_json_body
from .messages_api.errors import anthropic_error, is_messages_path
from .messages_api.output import sse_event
from .registry import ModelRegistry, ModelSlot
from .responses import SSE_HEADERS, SSE_MEDIA_TYPE
from .state import SLOT_KEY, ServerState
from .streaming import KEEPALIVE

log = logging.getLogger("proxy.api")
Endpoint = Callable[[Request], Awaitable[Response]]
HELD_KEY = "streamproxy.held"
"""The request scope's key of the slots it holds in flight (released by :class:`InFlight`)."""


class InFlight:
    """ASGI middleware: releases the models a request held once its response has ended (a stream's
    last byte included), so the registry never unloads a model under a running response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        held: list[ModelSlot] = []
        scope[HELD_KEY] = held
        try:
            await self.app(scope, receive, send)
        finally:
            for slot in held:
                slot.release()


def slot_of(registry: ModelRegistry, body: dict[str, Any]) -> ModelSlot:
    """The slot ``body["model"]`` names; ``body["model"]`` becomes its id.

    Raises:
        InvalidRequestError: ``model`` missing or not a string (400 naming ``model``).
        ModelNotFoundError: no model of that id or alias (404 ``model_not_found``).
    """
    name = body.get("model")
    if name is None and len(registry.slots) == 1:
        name = registry.slots[0].id
    if name is None:
        raise InvalidRequestError("'model' is required: this server serves several models (GET /v1/models "
                                  "lists them).", param="model")
    if not isinstance(name, str):
        raise InvalidRequestError("'model' must be a string.", param="model")
    slot = registry.find(name)
    body["model"] = slot.id
    return slot


def sole_model_id(state: ServerState, path: str) -> str | None:
    """The served id of a one-model server's model that ``path`` serves: the embedding model's for
    ``/v1/embeddings`` when one is served beside the chat model, else the chat model's; None while it
    is loading (the endpoint then answers its 503)."""
    if path.endswith("/embeddings") and state.embedder is not None:
        return state.embedder.served_model_name
    return state.client.model.served_model_name if state.client is not None else None


def error_event(path: str, exc: StreamproxyError) -> bytes:
    """The stream's error ending in the wire format of ``path``: Anthropic's ``error`` event, the
    Responses API's ``error`` event, or OpenAI's ``data: {"error": ...}`` and ``[DONE]``."""
    if is_messages_path(path):
        return sse_event("error", {"error": anthropic_error(exc)["error"]})
    if path.startswith("/v1/responses"):
        fields = {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param}
        return f"event: error\ndata: {json.dumps(fields)}\n\n".encode()
    return f"data: {json.dumps(exc.to_dict())}\n\ndata: [DONE]\n\n".encode()


async def loaded_before_grace_ends(state: ServerState, slot: ModelSlot, retry: bool = False,
                                   keepalive_s: float | None = None) -> AsyncGenerator[None, None]:
    """Load ``slot`` (``ModelRegistry.ensure_loaded``), yielding every ``keepalive_s`` seconds while
    it loads (None: never); ends when it is loaded.

    Raises:
        ServiceUnavailableError: the load's 503, or ``server_shutdown`` when the shutdown's grace
            period ends first (``ServerState.grace_over``).
    """
    registry = state.registry
    assert registry is not None
    load = asyncio.ensure_future(registry.ensure_loaded(slot, retry))
    over = asyncio.ensure_future(state.grace_over().wait())
    try:
        while True:
            done = (await asyncio.wait({load, over}, timeout=keepalive_s,
                                       return_when=asyncio.FIRST_COMPLETED))[0]
            if load in done:
                load.result()
                return
            if over in done:
                state.check_grace()
            yield None
    finally:
        for waiter in (load, over):
            if not waiter.done():
                waiter.cancel()  # this waiter only: the load itself is shielded and goes on


async def until_loaded(state: ServerState, slot: ModelSlot, retry: bool = False) -> None:
    """:func:`loaded_before_grace_ends` without keep-alives (a non-stream request, ``/models/load``)."""
    async for _ in loaded_before_grace_ends(state, slot, retry):
        pass


async def _load_then_stream(request: Request, endpoint: Endpoint, state: ServerState,
                            slot: ModelSlot, keepalive_s: float | None) -> AsyncIterator[bytes]:
    yield KEEPALIVE
    waiting = loaded_before_grace_ends(state, slot, keepalive_s=keepalive_s)
    try:
        async for _ in waiting:
            yield KEEPALIVE
        response = await endpoint(request)
    except StreamproxyError as exc:
        yield error_event(request.url.path, exc)
        return
    except ClientDisconnect:
        return
    except Exception:  # the headers went out: an error event, as the app's handler answers a 500
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        yield error_event(request.url.path, StreamproxyError("Internal server error."))
        return
    finally:
        await waiting.aclose()
    if not isinstance(response, StreamingResponse):
        yield b"data: " + bytes(response.body) + b"\n\n"
        return
    inner = response.body_iterator
    try:
        async for chunk in inner:
            yield chunk if isinstance(chunk, bytes) else str(chunk).encode()
    finally:
        close = getattr(inner, "aclose", None)
        if close is not None:
            await close()


def on_demand(endpoint: Endpoint, *, streams: bool = False) -> Endpoint:
    """``endpoint`` routed by ``model`` on a several-model server (module docstring); ``streams``:
    the endpoint can answer ``"stream": true`` with SSE."""

    async def routed(request: Request) -> Response:
        state = request.app.state.server
        registry: ModelRegistry | None = state.registry
        body = await read_json_body(request, state.settings.max_body_bytes)
        request.scope[BODY_KEY] = body
        if registry is None:
            if body.get("model") is None:
                sole = sole_model_id(state, request.url.path)
                if sole is not None:
                    body["model"] = sole
            return await endpoint(request)
        state.check_not_draining()
        slot = slot_of(registry, body)
        slot.acquire()
        request.scope[HELD_KEY].append(slot)
        request.scope[SLOT_KEY] = slot
        if slot.status == "loaded" or not (streams and body.get("stream") is True):
            if slot.status != "loaded":
                await until_loaded(state, slot)
            return await endpoint(request)
        keepalive_s = state.settings.keepalive_interval_s or None
        return StreamingResponse(_load_then_stream(request, endpoint, state, slot, keepalive_s),
                                 headers=dict(SSE_HEADERS), media_type=SSE_MEDIA_TYPE)

    routed.__doc__ = endpoint.__doc__
    return routed
