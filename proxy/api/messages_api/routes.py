"""The Messages API routes (Anthropic "Messages"): create a message, count its tokens."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from proxy.errors import ContextLengthExceededError, InvalidRequestError
from proxy.pipeline import PreparedRequest, check_model, prepare_chat, render_chat
from proxy.pipeline.reasoning_controls import thinking_budget
from proxy.protocol.messages_request import MessagesRequest, messages_param, parse_messages_request

from ..body import read_json_body
from ..responses import json_response
from ..state import ServedModel, ServerState
from .context import ManagedContext, manage_context
from .run import MessageRun

ENDPOINT = "/v1/messages"


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


async def _parse(request: Request, count_only: bool) -> tuple[ServerState, ServedModel, ManagedContext]:
    """Read, validate and apply the ``context_management`` edits (:mod:`.context`)."""
    state = _state(request)
    body = await read_json_body(request, state.settings.max_body_bytes)
    served = state.model_of(request)
    client = served.client
    if not count_only:
        client.metrics.observe_request(ENDPOINT)

    def parse(b: dict[str, Any]) -> MessagesRequest:
        return parse_messages_request(b, vocab_size=client.model.vocab_size, count_only=count_only)

    async def count(parsed: MessagesRequest) -> int:
        try:
            return len(await _prompt_ids(served, parsed))
        except InvalidRequestError as exc:
            raise messages_param(exc, parsed.paths) from None

    parsed = parse(body)
    if parsed.context_edits:
        check_model(client, parsed.chat.model)
    return state, served, await manage_context(parsed, parse, count)


async def _prompt_ids(served: ServedModel, parsed: MessagesRequest) -> list[int]:
    """The prompt ids ``parsed`` renders to (the chat template, a prefill left open), as generated."""
    prefill = parsed.prefill
    rendered = await render_chat(parsed.chat, served.client, served.features,
                                 add_generation_prompt=not prefill, continue_final_message=prefill)
    return rendered.prompt_ids


async def _prepare(served: ServedModel, parsed: MessagesRequest) -> PreparedRequest:
    """The chat pipeline's preparation of ``parsed``, with ``max_tokens`` lowered to what the context
    leaves (the chat request has none, so the pipeline resolves it to the rest of the context).

    Raises:
        InvalidRequestError: a prompt that does not fit, as Anthropic words it (``prompt is too long:
            N tokens > M maximum``, M the context less the one token the answer needs); any other
            error of the pipeline with the Messages field names.
    """
    client = served.client
    try:
        prepared = await prepare_chat(parsed.chat, client, served.features,
                                      continue_final_message=parsed.prefill)
    except ContextLengthExceededError:
        ids = await _prompt_ids(served, parsed)
        limit = client.model.max_model_len - 1
        raise InvalidRequestError(f"prompt is too long: {len(ids)} tokens > {limit} maximum",
                                  param="messages") from None
    except InvalidRequestError as exc:
        raise messages_param(exc, parsed.paths) from None
    if parsed.max_tokens is not None and parsed.max_tokens < prepared.params.max_tokens:
        prepared = replace(prepared, params=replace(prepared.params, max_tokens=parsed.max_tokens))
    return prepared


async def create_message(request: Request) -> Response:
    """``POST /v1/messages`` (Anthropic "Create a Message"), stream and non-stream: parse
    (``proxy.protocol.messages_request``, as the chat request it means), prepare, generate, respond."""
    state, served, managed = await _parse(request, count_only=False)
    prepared = await _prepare(served, managed.request)
    run = MessageRun(served.client, managed.request, prepared, managed.response_field())
    return await run.respond(request, state.settings)


async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens`` (Anthropic "Count tokens in a Message"): ``{"input_tokens":
    N}``, the prompt's length as the same body would be generated (system, tools and thinking
    switch rendered by the chat template): a message's ``input_tokens + cache_read_input_tokens``.
    With ``context_management``: the count after the edits, and ``context_management.
    original_input_tokens`` the count before them (Anthropic's ``BetaMessageTokensCount``)."""
    _, served, managed = await _parse(request, count_only=True)
    parsed = managed.request
    check_model(served.client, parsed.chat.model)
    try:
        ids = await _prompt_ids(served, parsed)
        budget = parsed.chat.thinking_token_budget
        if budget is not None:  # refused here as POST /v1/messages refuses it
            thinking_budget(budget, served.client.tokenizer, served.features.reasoning_parser, True)
    except InvalidRequestError as exc:
        raise messages_param(exc, parsed.paths) from None
    body: dict[str, Any] = {"input_tokens": len(ids)}
    if parsed.context_edits:
        original = managed.original_input_tokens
        body["context_management"] = {"original_input_tokens": len(ids) if original is None else original}
    return json_response(body)
