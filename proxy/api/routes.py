"""The endpoints, each short: read, validate, generate, respond.

Starlette ``Request`` in, ``Response`` out; a :class:`~proxy.errors.StreamproxyError` raised
anywhere becomes an OpenAI error object (``app.py`` registers the handler). The engine is reached
only through the :class:`~proxy.engine.client.EngineClient` in ``ServerState``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from proxy import protocol
from proxy.engine.client import EngineClient
from proxy.errors import InvalidRequestError, ModelNotFoundError, ServiceUnavailableError
from proxy.sampling import StructuredOutputParams
from proxy.tools import ToolCallParser, detect_parser
from proxy.tools.request import ChatTools, template_messages, tool_system_prompt

from .body import read_json_body
from .completion import respond
from .faults import parse_arm_body
from .responses import json_response
from .state import ServerState

LARGE_PROMPT_CHARS = 4096
"""Prompts longer than this are tokenized in a worker thread, off the event loop."""


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


# ----------------------------------------------------------------------------- info


async def health(request: Request) -> Response:
    """``GET /health``: 200 when the model is loaded and the engine runs, else 503.

    The body gives ``status`` (``loading``, ``ready``, ``failed``, ``draining``, ``dead``) and the
    engine counters (``num_running``, ``num_waiting``, ``num_free_blocks``, ``num_total_blocks``,
    ``num_tracked_outputs``, ``num_preemptions``: requests preempted so far because the KV cache
    was full, as ``streamproxy:num_preemptions_total`` in ``/metrics``).
    """
    state = _state(request)
    payload: dict[str, Any] = {"status": "draining" if state.is_draining else state.status}
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
    if state.load_error:
        payload["error"] = state.load_error
    return json_response(payload, status=200 if state.is_healthy else 503)


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text (``proxy.metrics``, vLLM's metric names); 503 while loading."""
    client = _state(request).client
    if client is None:
        raise ServiceUnavailableError("The model is still loading; no metrics yet.")
    from proxy.metrics import CONTENT_TYPE

    return Response(client.metrics.render(), media_type=CONTENT_TYPE)


async def list_models(request: Request) -> Response:
    """``GET /v1/models`` (OpenAI "List models")."""
    model = _state(request).require_ready().model
    card = protocol.model_card(model.served_model_name, model.created, model.max_model_len, dtype=model.dtype,
                                quantization=model.quantization)
    return json_response({"object": "list", "data": [card, *_state(request).extra_model_cards()]})


async def get_model(request: Request) -> Response:
    """``GET /v1/models/{model_id}`` (OpenAI "Retrieve model"); 404 for another id."""
    model = _state(request).require_ready().model
    model_id = request.path_params.get("model_id", "")
    if model_id != model.served_model_name:
        raise ModelNotFoundError(f"The model '{model_id}' does not exist.", param="model")
    return json_response(protocol.model_card(model.served_model_name, model.created, model.max_model_len,
                                             dtype=model.dtype, quantization=model.quantization))


# ----------------------------------------------------------------------------- completions


def _check_model(client: EngineClient, requested: str) -> None:
    served = client.model.served_model_name
    if requested != served:
        raise ModelNotFoundError(f"The model '{requested}' does not exist; this server serves '{served}'.",
                                 param="model")


async def _tokenize(func: Callable[[], list[int]], size: int) -> list[int]:
    return await asyncio.to_thread(func) if size > LARGE_PROMPT_CHARS else func()


_KIND_METRIC = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
                "grammar": "grammar"}


PROMPTED_TOOL_PARSER = "hermes"
"""The call format taught by the system prompt on a chat template without tool support (unless
``--tool-call-parser`` names another): explicit open and close markers, so text around a call
streams as content, and the format of the Hermes and Qwen fine-tunes."""


def _tool_format(client: EngineClient, parser_setting: str) -> tuple[bool, str | None]:
    """(the chat template renders tools, the tool-call parser for ``"auto"``: ``--tool-call-parser``,
    else detected from the template; None when neither)."""
    template = getattr(client.tokenizer.hf_tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else None
    detected = detect_parser(template)
    has_tools = detected is not None or (template is not None and "tools" in template)
    return has_tools, parser_setting or detected


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{text}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions`` (OpenAI "Create chat completion"), stream and non-stream.

    With ``tools``: the tools go to the chat template (``tools=``), or, for a template without tool
    support, into a system message (:func:`~proxy.tools.request.tool_system_prompt`; for ``auto`` it
    teaches :data:`PROMPTED_TOOL_PARSER`'s format and the answer goes through that parser).
    ``required`` / named choices and ``response_format`` are enforced with a grammar compiled off
    the event loop before the request is submitted.
    """
    state = _state(request)
    body = await read_json_body(request, state.settings.max_body_bytes)
    client = state.require_ready()
    chat = protocol.parse_chat_request(body, max_n=state.max_n, vocab_size=client.model.vocab_size)
    _check_model(client, chat.model)
    tools: ChatTools | None = chat.tools
    has_tools, parser_name = _tool_format(client, state.settings.tool_call_parser)
    prompted = tools is not None and tools.is_parsed and not has_tools  # "auto" taught by a system prompt
    if prompted:
        parser_name = parser_name or PROMPTED_TOOL_PARSER
    messages = template_messages([dict(m) for m in chat.messages], list(chat.raw_messages),
                                 template_has_tools=has_tools, call_format=parser_name if prompted else None)
    template_kwargs: dict[str, Any] = {}
    so: StructuredOutputParams | None = chat.structured
    so_param = chat.structured_param or "response_format"
    metric_kind = _KIND_METRIC[so.kind] if so is not None else None
    if tools is not None:
        if tools.is_parsed and parser_name is None:
            raise InvalidRequestError(
                "This model's chat template renders tools in a format no tool-call parser here reads, so "
                "tool_choice 'auto' cannot be served; start the server with --tool-call-parser, or use "
                "tool_choice 'required' or a named function (enforced with a grammar).", param="tool_choice")
        if has_tools:
            template_kwargs["tools"] = tools.template_tools()
        elif tools.is_constrained or prompted:
            messages = _with_system(messages, tool_system_prompt(tools, parser_name))
        if tools.is_constrained:
            so, so_param = tools.grammar(), "tools"
            metric_kind = "tool_named" if tools.choice.mode == "named" else "tool_required"
    size = sum(len(str(m.get("content") or "")) for m in messages)
    prompt_ids = await _tokenize(
        lambda: client.tokenizer.apply_chat_template(messages, **template_kwargs), size
    )
    max_tokens = protocol.resolve_max_tokens(chat.max_tokens, len(prompt_ids), client.model.max_model_len)
    params = replace(chat.params, max_tokens=max_tokens)
    if tools is not None and tools.is_parsed and parser_name is not None:
        # the parser's markers stay in the text where they are special tokens (Mistral's [TOOL_CALLS])
        keep = client.tokenizer.special_ids_of(ToolCallParser(parser_name).marker_texts)
        if keep:
            params = replace(params, keep_special_ids=keep)
    if so is not None:
        await client.prepare_structured_output(so, so_param)
        params = replace(params, structured_outputs=so)
        assert metric_kind is not None
        client.metrics.observe_structured_output(metric_kind)
    return await respond(request, client, protocol.CHAT, prompt_ids, params, chat.n, chat.stream,
                         state.settings.keepalive_interval_s or None,
                         state.settings.stream_headers_timeout_s or None,
                         tools=tools if tools is not None and tools.choice.mode != "none" else None,
                         parser_name=parser_name)


async def completions(request: Request) -> Response:
    """``POST /v1/completions`` (OpenAI legacy "Create completion"), stream and non-stream."""
    state = _state(request)
    body = await read_json_body(request, state.settings.max_body_bytes)
    client = state.require_ready()
    cmpl = protocol.parse_completion_request(body, max_n=state.max_n, vocab_size=client.model.vocab_size)
    _check_model(client, cmpl.model)
    prompt = cmpl.prompt
    if isinstance(prompt, tuple):
        prompt_ids = list(prompt)
    else:
        prompt_ids = await _tokenize(lambda: client.tokenizer.encode(prompt), len(prompt))
    max_tokens = protocol.resolve_max_tokens(cmpl.max_tokens, len(prompt_ids), client.model.max_model_len,
                                             prompt_name="prompt")
    params = replace(cmpl.params, max_tokens=max_tokens)
    return await respond(request, client, protocol.COMPLETION, prompt_ids, params, cmpl.n, cmpl.stream,
                         state.settings.keepalive_interval_s or None,
                         state.settings.stream_headers_timeout_s or None)


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
