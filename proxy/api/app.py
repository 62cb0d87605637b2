"""``create_app``: the Starlette application (middleware, lifespan, routes table, error handlers).

The model is loaded in the app's lifespan, in a worker thread, so the server answers at once:
``/health`` is 503 (``"loading"``) until the engine runs, then 200; completions are 503
meanwhile. The "ready" line is logged when loading finishes.

Errors: a :class:`~proxy.errors.StreamproxyError` from any route becomes its OpenAI error object
and status (429 adds ``Retry-After``), or on the Anthropic Messages paths Anthropic's envelope
(``proxy.api.messages_api.errors``); Starlette's 404/405 become such errors too; a client that
left before its response started gets a 499 nobody reads; anything else is a 500 JSON error
(logged with its traceback). Middleware, outermost first: CORS (``--allowed-origins``), then the
bearer-key check (``--api-key``).

Graceful shutdown: whoever runs the app calls ``app.state.server.begin_drain()`` when shutdown
starts (``proxy.cli`` does it from its ``uvicorn.Server`` subclass); see ``state.ServerState``.
The test-only fault hook (``proxy.api.faults``) is mounted only with ``enable_test_faults=True``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.catalog import build_catalog
from proxy.engine.client import EmbeddingClient, EngineClient, ModelInfo
from proxy.errors import MethodNotAllowedError, NotFoundError, StreamproxyError
from proxy.settings import Settings
from proxy.threads import start_in_own_thread

from . import embeddings, multi, render, routes, tokenize, worker_info
from .auth import ApiKeyMiddleware
from .faults import FaultInjector
from .messages_api import routes as messages_api
from .messages_api.errors import anthropic_error_response, is_messages_path
from .multi import EmbeddingFactory, EngineFactory
from .on_demand import InFlight, on_demand
from .responses import error_response
from .responses_api import routes as responses_api
from .state import ServerState
from .ui import INDEX as UI_INDEX
from .ui import asset as ui_asset

log = logging.getLogger("proxy.api")

Loaded = TypeVar("Loaded")


def _error(request: Request, exc: StreamproxyError, headers: dict[str, str] | None = None) -> Response:
    """The error response of ``exc`` in the wire format of the request's endpoint: Anthropic's
    envelope on the Messages endpoints, OpenAI's error object everywhere else."""
    if is_messages_path(request.url.path):
        return anthropic_error_response(exc, headers)
    return error_response(exc, headers)


async def _streamproxy_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StreamproxyError)
    return _error(request, exc)


async def _client_disconnect(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)


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
    return _error(request, err, dict(exc.headers or {}))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error in %s %s", request.method, request.url.path)
    return _error(request, StreamproxyError("Internal server error."))


async def _root_head(request: Request) -> Response:
    """``/`` without the chat page: ``HEAD`` answers 200 with no body (Claude Code probes it first),
    ``GET`` is the 404 it was before (the chat page, when on, answers both itself)."""
    if request.method != "HEAD":
        raise HTTPException(404)
    return Response(status_code=200)


def ready_message(settings: Settings, model_name: str, served_as: str = "") -> str:
    """The one "ready" log line: what is served (``served_as``: dtype and quantization), URL and a
    curl example."""
    base = f"http://{settings.host}:{settings.port}"
    body = json.dumps(
        {"model": model_name, "messages": [{"role": "user", "content": "Hello!"}], "stream": True}
    )
    what = f" ({served_as})" if served_as else ""
    return (
        f"streamproxy ready: serving '{model_name}'{what} at {base}/v1 -- try: "
        f"curl -N {base}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"
    )


def default_engine_factory(settings: Settings) -> EngineClient:
    """Load ``settings.model`` behind an engine client (``proxy.engine.factory``; not started)."""
    from proxy.engine.factory import build_engine_client

    return build_engine_client(settings)


def on_demand_engine_factory(settings: Settings) -> EngineClient:
    """A several-model server's engine factory while another model serves: :func:`default_engine_factory`'s,
    the load at ``proxy.engine.factory.ON_DEMAND_LOAD_NICE`` (it yields the cores to the models
    serving; ``proxy.api.multi.build_registry``)."""
    from proxy.engine.factory import ON_DEMAND_LOAD_NICE, build_engine_client

    return build_engine_client(settings, ON_DEMAND_LOAD_NICE)


async def _ui_page(request: Request) -> Response:
    """``GET /`` (the chat page) and ``GET /ui/{name}`` (its stylesheet and script); see ``proxy.api.ui``."""
    found = ui_asset(request.path_params.get("name", UI_INDEX))
    if found is None:
        raise HTTPException(404)
    return Response(found.body, media_type=found.media_type, headers=found.headers)


async def in_own_thread(fn: Callable[[Settings], Loaded], settings: Settings) -> Loaded:
    """``fn(settings)`` on a new thread that ends when it returns, not ``asyncio.to_thread``'s pool
    (why: ``proxy.threads``)."""
    return await asyncio.wrap_future(start_in_own_thread(fn, settings, name="streamproxy-load"))


def default_embedding_factory(settings: Settings, chat: ModelInfo) -> EmbeddingClient:
    """The embedding worker of ``settings`` (``proxy.engine.factory.build_embedding_client``; started)."""
    from proxy.engine.factory import build_embedding_client

    return build_embedding_client(settings, chat)


def create_app(settings: Settings, engine_factory: EngineFactory | None = None, *,
               enable_test_faults: bool = False,
               embedding_factory: EmbeddingFactory | None = None,
               on_load_failed: Callable[[str], None] | None = None) -> Starlette:
    """The Starlette app serving ``settings.model``, or with several models
    (``proxy.catalog.build_catalog``) each loaded at its first request (``proxy.api.registry``).

    Args:
        settings: server and engine settings.
        engine_factory: called in a worker thread at startup; returns an
            :class:`~proxy.engine.client.EngineClient`, which is then started on the event loop.
            Default: :func:`proxy.engine.factory.build_engine_client`.
        enable_test_faults: TEST ONLY. Install a :class:`~proxy.api.faults.FaultInjector` as the
            engine's ``fault_injector`` and mount ``POST /_test/fault`` to arm it. Never in production.
        embedding_factory: called in a worker thread after the engine is loaded; returns the started
            :class:`~proxy.engine.client.EmbeddingClient` of ``/v1/embeddings``. Default:
            :func:`proxy.engine.factory.build_embedding_client`.
        on_load_failed: called with the one-line reason when the one model cannot be loaded (the
            CLI then exits non-zero); None: the server stays up, ``/health`` ``failed``.

    The :class:`~proxy.api.state.ServerState` is ``app.state.server``.
    """
    factory = engine_factory or default_engine_factory
    embed_factory = embedding_factory or default_embedding_factory
    state = ServerState(settings, FaultInjector() if enable_test_faults else None)
    entries = build_catalog(settings)
    if entries:
        state.registry = multi.build_registry(settings, entries, state, factory, embed_factory,
                                              None if engine_factory else on_demand_engine_factory)
        state.server_metrics = multi.server_metrics(state)

    async def load() -> None:
        try:
            client = await in_own_thread(factory, settings)
            client.start()
            if state.fault_injector is not None:
                client.fault_injector = state.fault_injector
            try:
                state.embedder = await in_own_thread(lambda s: embed_factory(s, client.model), settings)
            except BaseException:
                client.shutdown()
                raise
        except Exception as exc:
            # the log and the terminal are the user's own: their path shows there, never over HTTP
            reason = f"{type(exc).__name__}: {multi.load_failure_reason(exc, '', None, hide_paths=False)}"
            hidden = f"{type(exc).__name__}: {multi.load_failure_reason(exc, 'the model', settings.model)}"
            log.error("loading the model failed: %s", reason)
            log.debug("load failure", exc_info=True)
            state.set_failed(f"Loading the model failed: {hidden}")
            if on_load_failed is not None:
                on_load_failed(reason)
            return
        state.set_ready(client)
        info = client.model
        if info.execution is not None:  # which kernels serve the steps (proxy.engine.execution.plan)
            log.info("%s", info.execution["summary"])
        served_as = ", ".join(
            f"{k} {v}" for k, v in (("dtype", info.dtype), ("quantization", info.quantization)) if v
        )
        log.info("%s", ready_message(settings, info.served_model_name, served_as))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        registry = state.registry
        if registry is not None:
            if engine_factory is None:  # the real engines: their tokenizers read before any serves
                registry.before_serving = multi.start_read_ahead(registry)
            registry.start()
            state.status = "ready"
            names = ", ".join(f"'{s.id}'" for s in registry.slots)
            log.info("streamproxy ready: %d models at http://%s:%d/v1, each loaded at its first request: %s",
                     len(registry.slots), settings.host, settings.port, names)
            try:
                yield
            finally:
                state.cancel_drain_timer()
                await registry.close()
                state.status = "stopped"
            return
        task = asyncio.create_task(load())
        try:
            yield
        finally:
            if not task.done():
                task.cancel()
            state.cancel_drain_timer()
            if state.client is not None:
                with contextlib.suppress(Exception):
                    state.client.shutdown()
            if state.embedder is not None:
                state.embedder.shutdown()
            state.status = "stopped"

    table = [
        Route("/health", routes.health, methods=["GET"]),
        Route("/metrics", routes.metrics, methods=["GET"]),
        Route("/v1/models", routes.list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", routes.get_model, methods=["GET"]),
        Route("/v1/chat/completions", on_demand(routes.chat_completions, streams=True), methods=["POST"]),
        Route("/v1/completions", on_demand(routes.completions, streams=True), methods=["POST"]),
        Route("/v1/chat/completions/render", on_demand(render.render_chat_completion), methods=["POST"]),
        Route("/v1/completions/render", on_demand(render.render_completion), methods=["POST"]),
        Route("/tokenize", on_demand(tokenize.tokenize), methods=["POST"]),
        Route("/detokenize", on_demand(tokenize.detokenize), methods=["POST"]),
        Route("/server_info", worker_info.server_info, methods=["GET"]),
        Route("/get_server_info", worker_info.server_info, methods=["GET"]),
        Route("/model_info", worker_info.model_info, methods=["GET"]),
        Route("/get_model_info", worker_info.model_info, methods=["GET"]),
        Route("/v1/responses", on_demand(responses_api.create_response, streams=True), methods=["POST"]),
        Route("/v1/responses/input_tokens", on_demand(responses_api.count_input_tokens), methods=["POST"]),
        Route("/v1/responses/render", on_demand(render.render_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", responses_api.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses_api.delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", responses_api.list_input_items, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", responses_api.cancel_response, methods=["POST"]),
        Route("/v1/messages", on_demand(messages_api.create_message, streams=True), methods=["POST"]),
        Route("/v1/messages/count_tokens", on_demand(messages_api.count_tokens), methods=["POST"]),
        Route("/v1/embeddings", on_demand(embeddings.create_embeddings), methods=["POST"]),
    ]
    if entries:
        table += [Route("/models/load", multi.load_model, methods=["POST"]),
                  Route("/models/unload", multi.unload_model, methods=["POST"])]
    if settings.ui:
        table += [Route("/", _ui_page, methods=["GET"]), Route("/ui/{name}", _ui_page, methods=["GET"])]
    else:
        table.append(Route("/", _root_head, methods=["GET"]))  # Starlette adds HEAD to GET routes
    if enable_test_faults:
        log.warning("TEST-ONLY fault injection is enabled (POST /_test/fault); never use this in production")
        table.append(Route("/_test/fault", routes.arm_fault, methods=["POST"]))
    middleware = []
    if settings.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"]))
    if settings.api_keys:
        middleware.append(Middleware(ApiKeyMiddleware, api_keys=tuple(settings.api_keys)))
    if entries:
        middleware.append(Middleware(InFlight))
    handlers = {StreamproxyError: _streamproxy_error, ClientDisconnect: _client_disconnect,
                HTTPException: _http_exception, Exception: _internal_error}
    app = Starlette(routes=table, middleware=middleware, lifespan=lifespan, exception_handlers=handlers)
    app.state.server = state
    return app
