"""The Starlette application; the only module that imports Starlette.

``create_app(settings, engine_factory)`` builds the app. The model is loaded in the app's
lifespan, in a worker thread, so the server answers at once: ``/health`` is 503 (``"loading"``)
until the engine runs, then 200; completions are 503 meanwhile. The "ready" line is logged when
loading finishes.

HTTP concerns live here: the body is read under ``max_body_bytes`` (413 from ``Content-Length``
or while streaming the body), any ``Content-Type`` is accepted when the body is JSON (so
``text/plain`` with a JSON body works, as documented in the README), errors become OpenAI error
objects (404 unknown route, 405 wrong method, 500 without a traceback), an optional bearer-key
check (401; keys are compared in constant time and never logged), CORS, ``Retry-After`` on 429,
and a disconnect watcher per request that aborts its engine requests.

Graceful shutdown: whoever runs the app calls ``app.state.server.begin_drain()`` when shutdown
starts (``proxy.cli`` does it from its ``uvicorn.Server`` subclass); see ``routes.ServerState``.
The test-only fault hook (``proxy.api.faults``) is mounted only with ``enable_test_faults=True``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from proxy.engine.output import OutputProcessor
from proxy.errors import (
    AuthenticationError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    StreamproxyError,
)
from proxy.metrics import Metrics
from proxy.settings import Settings

from . import routes
from .faults import FaultInjector, parse_arm_body
from .observe import MetricsRecorder
from .routes import ApiRequest, BytesReply, EmptyReply, JsonReply, ServerState, ServingModel, StreamReply

log = logging.getLogger("proxy.api")

EngineFactory = Callable[[Settings], ServingModel]
Handler = Callable[[ServerState, ApiRequest], Awaitable[Any]]


def _json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    # backslashreplace: a stray surrogate in a message becomes the JSON escape "\\udXXX", never a 500
    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")
    return Response(body, status_code=status, headers=headers, media_type="application/json")


RETRY_AFTER_S = 1
"""``Retry-After`` (seconds) of a 429: the waiting queue turns over within about a second of decode."""


def _error_response(exc: StreamproxyError, headers: dict[str, str] | None = None) -> Response:
    if isinstance(exc, RateLimitError):
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
    return _json_response(exc.to_dict(), exc.status, headers)


async def _read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed ``limit`` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLargeError(f"The request body is {length} bytes; the limit is {limit} bytes.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"The request body exceeds the limit of {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


async def _watch_disconnect(request: Request, api_request: ApiRequest) -> None:
    """Wait for ``http.disconnect`` after the body was read; then mark the request disconnected."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            api_request.mark_disconnected()
            return


def _check_auth(settings: Settings, request: Request) -> None:
    if not settings.api_keys or not request.url.path.startswith("/v1"):
        return
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    given = key.strip().encode("utf-8", "surrogateescape")
    # compare with every key, in constant time per key (no early exit on a match)
    ok = False
    for accepted in settings.api_keys:
        ok |= hmac.compare_digest(given, accepted.encode("utf-8", "surrogateescape"))
    if scheme.lower() != "bearer" or not ok:
        raise AuthenticationError("Missing or invalid API key (send 'Authorization: Bearer <key>').")


def _endpoint(state: ServerState, handler: Handler, *, reads_body: bool) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        api_request = ApiRequest(headers=request.headers, path_params=request.path_params)
        watcher: asyncio.Task[None] | None = None
        try:
            _check_auth(state.settings, request)
            if reads_body:
                api_request.body = await _read_body(request, state.settings.max_body_bytes)
            watcher = asyncio.create_task(_watch_disconnect(request, api_request))
            reply = await handler(state, api_request)
        except StreamproxyError as exc:
            if watcher is not None:
                watcher.cancel()
            return _error_response(exc)
        except ClientDisconnect:
            if watcher is not None:
                watcher.cancel()
            return Response(status_code=499)
        except Exception:
            if watcher is not None:
                watcher.cancel()
            log.exception("unhandled error in %s %s", request.method, request.url.path)
            return _error_response(StreamproxyError("Internal server error."))
        if isinstance(reply, StreamReply):
            return StreamingResponse(_until_done(reply.body, watcher), status_code=reply.status,
                                     headers=reply.headers, media_type=reply.media_type)
        assert watcher is not None
        watcher.cancel()
        if isinstance(reply, EmptyReply):
            return Response(status_code=499)
        if isinstance(reply, BytesReply):
            return Response(reply.body, status_code=reply.status, media_type=reply.media_type)
        assert isinstance(reply, JsonReply)
        return _json_response(reply.payload, reply.status, reply.headers)

    return endpoint


async def _until_done(body: AsyncIterator[bytes], watcher: asyncio.Task[None] | None) -> AsyncIterator[bytes]:
    """The SSE body; the disconnect watcher lives exactly as long as it."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        if watcher is not None:
            watcher.cancel()
        aclose = getattr(body, "aclose", None)
        if aclose is not None:
            await aclose()


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err: StreamproxyError = NotFoundError(f"No route for {request.method} {request.url.path}.")
    elif exc.status_code == 405:
        err = MethodNotAllowedError(f"Method {request.method} is not allowed for {request.url.path}.")
    else:
        err = StreamproxyError(str(exc.detail))
        err.status = exc.status_code
        err.type = "invalid_request_error"
    return _error_response(err, dict(exc.headers or {}))


def ready_message(settings: Settings, model_name: str) -> str:
    """The one "ready" log line: URL and a curl example."""
    base = f"http://{settings.host}:{settings.port}"
    body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": "Hello!"}], "stream": True})
    return (f"streamproxy ready: serving '{model_name}' at {base}/v1 -- try: curl -N {base}/v1/chat/completions "
            f"-H 'Content-Type: application/json' -d '{body}'")


def default_engine_factory(settings: Settings) -> ServingModel:
    """Load the model of ``settings`` and wrap it in an ``AsyncEngine`` (not started)."""
    from .serving import build_serving_model

    return build_serving_model(settings)


async def _arm_fault(state: ServerState, req: ApiRequest) -> JsonReply:
    """``POST /_test/fault`` (test-only): arm the fault injector, see ``proxy.api.faults``."""
    state.require_ready()
    injector: FaultInjector = state.fault_injector
    try:
        after, fail = parse_arm_body(json.loads(req.body) if req.body.strip() else {})
    except ValueError as exc:
        raise InvalidRequestError(f"Bad fault spec: {exc}") from None
    injector.arm(after, fail)
    return JsonReply({"armed": True, "after_steps": after, "fail_steps": fail})


def create_app(settings: Settings, engine_factory: EngineFactory | None = None, *,
               enable_test_faults: bool = False) -> Starlette:
    """The Starlette app serving ``settings.model``.

    Args:
        settings: server and engine settings.
        engine_factory: called in a worker thread at startup; returns a :class:`ServingModel`
            whose engine is started on the event loop. Default: load ``settings.model`` with
            ``proxy.models.load_model`` and build ``EngineCore`` + ``AsyncEngine``.
        enable_test_faults: TEST ONLY. Install a :class:`~proxy.api.faults.FaultInjector` as the
            engine's ``fault_injector`` and mount ``POST /_test/fault`` to arm it. Never in production.

    The ``ServerState`` is ``app.state.server``.
    """
    factory = engine_factory or default_engine_factory
    state = ServerState(settings)
    state.fault_injector = FaultInjector() if enable_test_faults else None

    async def load() -> None:
        try:
            model = await asyncio.to_thread(factory, settings)
            model.engine.start()
            engine = model.engine
            if state.fault_injector is not None:
                engine.fault_injector = state.fault_injector
            metrics = Metrics(model.served_model_name, num_running=lambda: engine.num_running,
                              num_waiting=lambda: engine.num_waiting, kv_cache_usage=lambda: engine.kv_cache_usage)
            recorder = MetricsRecorder(metrics)
            processor = OutputProcessor(model.tokenizer, engine.abort, observer=recorder.on_output,
                                        on_abort=recorder.on_abort)
        except Exception as exc:
            log.exception("loading the model failed")
            state.set_failed(f"Loading the model failed: {type(exc).__name__}: {exc}")
            return
        state.metrics = metrics
        state.set_ready(model, processor)
        log.info("%s", ready_message(settings, model.served_model_name))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(load())
        try:
            yield
        finally:
            if not task.done():
                task.cancel()
            state.cancel_drain_timer()
            if state.model is not None:
                with contextlib.suppress(Exception):
                    state.model.engine.shutdown()
            state.status = "stopped"

    def route(path: str, handler: Handler, method: str, *, reads_body: bool = False) -> Route:
        return Route(path, _endpoint(state, handler, reads_body=reads_body), methods=[method])

    app_routes = [
        route("/health", routes.health, "GET"),
        route("/metrics", routes.metrics, "GET"),
        route("/v1/models", routes.list_models, "GET"),
        route("/v1/models/{model_id:path}", routes.get_model, "GET"),
        route("/v1/chat/completions", routes.chat_completions, "POST", reads_body=True),
        route("/v1/completions", routes.completions, "POST", reads_body=True),
    ]
    if enable_test_faults:
        log.warning("TEST-ONLY fault injection is enabled (POST /_test/fault); never use this in production")
        app_routes.append(route("/_test/fault", _arm_fault, "POST", reads_body=True))
    middleware = []
    if settings.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"]))
    app = Starlette(routes=app_routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_exception})
    app.state.server = state
    return app
