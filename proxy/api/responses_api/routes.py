"""The Responses API routes (OpenAI "Responses"): create, retrieve, delete, input items, input tokens."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from proxy.errors import InvalidRequestError, NotFoundError
from proxy.pipeline import prepare_chat
from proxy.protocol.responses_request import parse_responses_request

from ..body import read_json_body
from ..responses import json_response
from ..state import ServedModel, ServerState
from .input_items import input_items_page
from .run import ResponseRun
from .store import StoredResponse

CONTEXT_NAMES = ("input", "max_output_tokens")
"""The Responses API's names of the prompt and the output budget in context-length errors."""


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


def _stored(state: ServerState, response_id: str, param: str | None = None) -> StoredResponse:
    """The stored response, or a 404 error object that says it is unknown or no longer stored."""
    entry = state.responses_store.get(response_id)
    if entry is None:
        raise NotFoundError(
            f"Response with id '{response_id}' not found: it was never stored here (store: false, another "
            "replica, or before a restart) or it was evicted (the store keeps the most recent ones).",
            param=param, code="response_not_found")
    return entry


async def _parse(request: Request) -> tuple[ServerState, ServedModel, Any]:
    state = _state(request)
    body = await read_json_body(request, state.settings.max_body_bytes)
    served = state.model_of(request)
    client = served.client
    previous = body.get("previous_response_id")
    prior: list[dict[str, Any]] = []
    if previous is not None:
        if not isinstance(previous, str):
            raise NotFoundError("'previous_response_id' must be a response id string.",
                                param="previous_response_id")
        stored = _stored(state, previous, "previous_response_id")
        if stored.response.get("status") == "in_progress":  # its output is not there yet (as OpenAI)
            raise InvalidRequestError(f"Previous response with id '{previous}' is still in progress; "
                                      "continue it once it has finished.", param="previous_response_id")
        prior = list(stored.conversation)
    parsed = parse_responses_request(body, prior, vocab_size=client.model.vocab_size,
                                     resolve=state.responses_store.item)
    return state, served, parsed


async def create_response(request: Request) -> Response:
    """``POST /v1/responses`` (OpenAI "Create a model response"), stream and non-stream: parse
    (``proxy.protocol.responses_request``, as the chat request it means), prepare, generate, respond."""
    state, served, parsed = await _parse(request)
    client = served.client
    client.metrics.observe_request("/v1/responses")
    prepared = await prepare_chat(parsed.chat, client, served.features, context_names=CONTEXT_NAMES)
    return await ResponseRun(client, parsed, prepared, state.responses_store).respond(request, state.settings)


async def count_input_tokens(request: Request) -> Response:
    """``POST /v1/responses/input_tokens`` (OpenAI "Get input token counts"): the prompt's length as
    the same request would be generated, ``{"object": "response.input_tokens", "input_tokens"}``."""
    _, served, parsed = await _parse(request)
    prepared = await prepare_chat(parsed.chat, served.client, served.features, context_names=CONTEXT_NAMES)
    return json_response({"object": "response.input_tokens", "input_tokens": len(prepared.prompt_ids)})


async def get_response(request: Request) -> Response:
    """``GET /v1/responses/{response_id}``: a stored response; 404 when unknown or evicted."""
    state = _state(request)
    return json_response(_stored(state, request.path_params["response_id"]).response)


async def delete_response(request: Request) -> Response:
    """``DELETE /v1/responses/{response_id}``: ``{"id", "object": "response", "deleted": true}``; 404
    when unknown."""
    state = _state(request)
    response_id = request.path_params["response_id"]
    _stored(state, response_id)
    state.responses_store.delete(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(request: Request) -> Response:
    """``POST /v1/responses/{response_id}/cancel``: OpenAI cancels only ``background`` responses,
    which this server refuses to create, so a stored response is a 400 saying so (as OpenAI answers
    for a response that was not created in the background); 404 when unknown."""
    state = _state(request)
    _stored(state, request.path_params["response_id"])
    raise InvalidRequestError("Only responses created with 'background': true can be cancelled; this "
                              "server does not run background responses.", param="response_id")


async def list_input_items(request: Request) -> Response:
    """``GET /v1/responses/{response_id}/input_items``: the items the response was generated from,
    as an OpenAI list in OpenAI's item shapes, paged by ``order`` (default ``desc``, newest first),
    ``limit``, ``after``, ``before`` (:mod:`~proxy.api.responses_api.input_items`)."""
    state = _state(request)
    entry = _stored(state, request.path_params["response_id"])
    items = entry.conversation[: len(entry.conversation) - len(entry.response["output"])]
    return json_response(input_items_page(items, dict(request.query_params)))
