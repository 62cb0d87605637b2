"""The endpoints, each short: read, validate, generate, respond.

Starlette ``Request`` in, ``Response`` out; a :class:`~proxy.errors.StreamproxyError` raised
anywhere becomes an OpenAI error object (``app.py`` registers the handler). The engine is reached
only through the :class:`~proxy.engine.client.EngineClient` in ``ServerState``.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from proxy import protocol
from proxy.errors import InvalidRequestError, ModelNotFoundError, ServiceUnavailableError
from proxy.pipeline import prepare_chat, prepare_completion

from . import multi
from .body import read_json_body
from .completion import respond
from .faults import parse_arm_body
from .responses import json_response
from .state import ServerState


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


# ----------------------------------------------------------------------------- info


async def health(request: Request) -> Response:
    """``GET /health``: 200 when the model is loaded and the engine runs, else 503.

    The body gives ``status`` (``loading``, ``ready``, ``failed``, ``draining``, ``dead``) and the
    engine counters (``num_running``, ``num_waiting``, ``num_free_blocks``, ``num_total_blocks``,
    ``num_tracked_outputs``, ``num_preemptions``: requests preempted so far because the KV cache
    was full, as ``streamproxy:num_preemptions_total`` in ``/metrics``) and the engine's
    ``execution`` plan (``proxy.engine.execution.plan``).
    """
    state = _state(request)
    payload: dict[str, Any] = {"status": "draining" if state.is_draining else state.status}
    if state.registry is not None:
        payload["models"] = multi.health_models(state.registry)
    client = state.client
    if client is not None:
        if not client.is_healthy and not state.is_draining:
            payload["status"] = "dead"
        stats = client.stats()
        payload["num_running"] = stats.num_running
        payload["num_waiting"] = stats.num_waiting
        if stats.num_free_blocks is not None:
            payload["num_free_blocks"] = stats.num_free_blocks
        if stats.num_total_blocks is not None:
            payload["num_total_blocks"] = stats.num_total_blocks
        payload["num_tracked_outputs"] = stats.num_tracked_outputs
        payload["num_preemptions"] = stats.num_preemptions
        if client.model.execution is not None:
            payload["execution"] = client.model.execution
    if state.load_error:
        payload["error"] = state.load_error
    return json_response(payload, status=200 if state.is_healthy else 503)


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text (``proxy.metrics``, vLLM's metric names); 503 while the one
    model loads; with several models also while none is loaded (their states, ``ServerMetrics``)."""
    state = _state(request)
    from proxy.metrics import CONTENT_TYPE, render_many

    if state.registry is not None:  # every loaded model's, told apart by model_name; the server's own
        return Response(render_many([c.metrics for c in state.clients()], state.server_metrics),
                        media_type=CONTENT_TYPE)
    client = state.client
    if client is None:
        raise ServiceUnavailableError("The model is still loading; no metrics yet.")
    return Response(client.metrics.render(), media_type=CONTENT_TYPE)


async def list_models(request: Request) -> Response:
    """``GET /v1/models`` (OpenAI "List models"); with several models, each with its status
    (``proxy.api.multi``)."""
    if _state(request).registry is not None:
        return multi.list_models(request)
    model = _state(request).require_ready().model
    card = protocol.model_card(model.served_model_name, model.created, model.max_model_len, dtype=model.dtype,
                                quantization=model.quantization)
    return json_response({"object": "list", "data": [card, *_state(request).extra_model_cards()]})


async def get_model(request: Request) -> Response:
    """``GET /v1/models/{model_id}`` (OpenAI "Retrieve model"): the chat model's card or the embedding
    model's (when served under its own id); 404 for another id."""
    state = _state(request)
    if state.registry is not None:
        return multi.get_model(request)
    model = state.require_ready().model
    model_id = request.path_params.get("model_id", "")
    if model_id != model.served_model_name:
        for card in state.extra_model_cards():
            if card["id"] == model_id:
                return json_response(card)
        raise ModelNotFoundError(f"The model '{model_id}' does not exist.", param="model")
    return json_response(protocol.model_card(model.served_model_name, model.created, model.max_model_len,
                                             dtype=model.dtype, quantization=model.quantization))


# ----------------------------------------------------------------------------- completions


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions`` (OpenAI "Create chat completion"), stream and non-stream: parse,
    prepare (``proxy.pipeline.prepare_chat``: template, tools, grammar), generate, respond."""
    state = _state(request)
    body = await read_json_body(request, state.settings.max_body_bytes)
    served = state.model_of(request)
    client = served.client
    client.metrics.observe_request("/v1/chat/completions")
    chat = protocol.parse_chat_request(body, max_n=state.max_n, vocab_size=client.model.vocab_size)
    prepared = await prepare_chat(chat, client, served.features)
    return await respond(request, client, protocol.CHAT, prepared, state.settings)


async def completions(request: Request) -> Response:
    """``POST /v1/completions`` (OpenAI legacy "Create completion"), stream and non-stream."""
    state = _state(request)
    body = await read_json_body(request, state.settings.max_body_bytes)
    client = state.model_of(request).client
    client.metrics.observe_request("/v1/completions")
    cmpl = protocol.parse_completion_request(body, max_n=state.max_n, vocab_size=client.model.vocab_size)
    prepared = await prepare_completion(cmpl, client)
    return await respond(request, client, protocol.COMPLETION, prepared, state.settings)


# ----------------------------------------------------------------------------- test-only


async def arm_fault(request: Request) -> Response:
    """``POST /_test/fault`` (test-only): arm the fault injector, see ``proxy.api.faults``."""
    state = _state(request)
    raw = await request.body()
    state.require_ready()
    assert state.fault_injector is not None
    try:
        after, fail = parse_arm_body(json.loads(raw) if raw.strip() else {})
    except ValueError as exc:
        raise InvalidRequestError(f"Bad fault spec: {exc}") from None
    state.fault_injector.arm(after, fail)
    return json_response({"armed": True, "after_steps": after, "fail_steps": fail})
