"""``POST /v1/responses`` bodies (OpenAI "Create a model response") -> the chat request they mean.

The Responses API is served by the same pipeline as Chat Completions: its ``input`` items,
``instructions``, ``tools``, ``tool_choice`` and ``text.format`` are translated into the equivalent
chat body (as vLLM's and LiteLLM's Responses layers do), which :func:`parse_chat_request` then
validates; every error names the Responses field (``input[2].content``, ``text.format.schema``,
``max_output_tokens``), never the chat one.

Translation (OpenAI "Conversation state" and "Function calling" guides):

- ``instructions`` -> a leading system message (not carried over from ``previous_response_id``).
- ``message`` items (``type`` optional) with roles ``user``, ``system``, ``developer``, ``assistant``;
  content a string or ``input_text`` / ``output_text`` / ``input_image`` parts (an image becomes a
  :class:`~proxy.protocol.images.ImagePart` naming ``input[i].content[j]``). ``input_file`` /
  ``input_audio`` are a 400 naming them.
- ``function_call`` items -> an assistant message's ``tool_calls`` (consecutive calls, and an assistant
  message right before them, form one assistant turn); ``function_call_output`` -> a ``tool`` message.
- ``reasoning`` items -> ``reasoning_content`` of the assistant turn that follows (templates that
  render past thinking read it; most drop it).
- ``item_reference`` items ``{type, id}`` -> the stored item with that id (an output item of a stored
  response, or an input item, which is given an id when stored), then as if sent inline; an unknown
  id is a 400 naming ``input[i].id``.
- function ``tools`` ``{type, name, description, parameters, strict}`` -> chat's ``{type, function}``;
  built-in tools (``web_search``, ``file_search``, ``computer_use``, ``code_interpreter``,
  ``image_generation``, ``mcp``, ...) are a 400 naming the type.
- ``text.format`` ``text`` / ``json_object`` / ``json_schema`` -> ``response_format``.
- ``max_output_tokens`` -> ``max_tokens``; ``reasoning.effort`` -> ``reasoning_effort``;
  ``include: ["message.output_text.logprobs"]`` -> ``logprobs`` (with ``top_logprobs``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from proxy.errors import InvalidRequestError

from .fields import _bad, _type_name, array_of_objects
from .requests import ChatCompletionRequest, parse_chat_request
from .responses_items import ItemResolver, chat_messages, input_items

BUILTIN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use", "computer_use_preview",
                 "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "apply_patch",
                 "custom")
UNSUPPORTED_FIELDS = ("background", "conversation", "prompt", "max_tool_calls")
"""Fields whose non-null values this server cannot honour (a 400 naming the field)."""
LOGPROBS_INCLUDE = "message.output_text.logprobs"
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs", "reasoning.encrypted_content", LOGPROBS_INCLUDE)
"""OpenAI's ``include`` values (openai-python ``ResponseIncludable``); any other is a 400, as there.
Only ``message.output_text.logprobs`` changes a response here: the others name outputs of built-in
tools (refused by name when asked for), image inputs (the stored input items keep the images as sent)
or encrypted reasoning, which this server does not produce (its reasoning items carry the text itself)."""
ECHOED_STRINGS = {"safety_identifier": 128, "prompt_cache_key": None}
"""String fields that are only echoed in the response object, with OpenAI's length limit (None: none
documented): ``safety_identifier`` (abuse detection at OpenAI; nothing to detect here) and
``prompt_cache_key`` (the prefix cache here is automatic: a key changes nothing)."""
_PASSTHROUGH = ("temperature", "top_p", "seed", "logit_bias", "stop", "top_k", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
                "parallel_tool_calls", "user", "chat_template_kwargs", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar", "structured_outputs")


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated Responses body.

    Attributes:
        chat: the equivalent chat request (what the pipeline prepares and runs).
        items: the conversation's input items as a list of dicts (the stored response's ``input``:
            the previous response's items and output first, then this request's ``input``).
        body: the request body as sent (for the echo of its parameters in the response object).
        store: keep the finished response (``store``, default true) for ``previous_response_id``.
        include_logprobs: ``include`` asked for ``message.output_text.logprobs``.
    """

    chat: ChatCompletionRequest
    items: list[dict[str, Any]]
    body: dict[str, Any]
    store: bool
    include_logprobs: bool


def chat_tools(value: Any) -> list[dict[str, Any]]:
    """Responses function tools -> chat ``tools``.

    Raises:
        InvalidRequestError: not an array, a built-in tool type (named), or a malformed tool.
    """
    out = []
    for p, tool in array_of_objects(value, "tools"):
        kind = tool.get("type")
        if kind != "function":
            if isinstance(kind, str) and (kind in BUILTIN_TOOLS or kind.startswith(BUILTIN_TOOLS)):
                raise _bad(f"{p}.type", f"Built-in tool '{kind}' is not supported by this server; only "
                           "'function' tools are.")
            raise _bad(f"{p}.type", f"'{p}.type' must be 'function'; got {kind!r}.")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(value: Any) -> Any:
    """Responses ``tool_choice`` -> chat's (``{type: "function", name}`` -> ``{type, function: {name}}``).

    Raises:
        InvalidRequestError: a hosted-tool or ``allowed_tools`` choice (named).
    """
    if isinstance(value, dict):
        kind = value.get("type")
        if kind == "function":
            return {"type": "function", "function": {"name": value.get("name")}}
        raise _bad("tool_choice.type", f"tool_choice type {kind!r} is not supported; use 'none', 'auto', "
                   "'required' or {'type': 'function', 'name': ...}.")
    return value


def response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` -> chat ``response_format`` (None: plain text).

    Raises:
        InvalidRequestError: ``text`` or ``text.format`` is malformed.
    """
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text", f"'text' must be an object, not {_type_name(text)}.")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format", f"'text.format' must be an object, not {_type_name(fmt)}.")
    kind = fmt.get("type")
    if kind == "json_schema":
        js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        if "schema" not in fmt:
            raise _bad("text.format.schema", "'text.format.schema' is required for type 'json_schema'.")
        return {"type": "json_schema", "json_schema": js}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise _bad("text.format.type", f"'text.format.type' must be one of 'text', 'json_object', 'json_schema'; "
               f"got {kind!r}.")


_RENAMES = ((re.compile(r"^response_format\.json_schema\."), "text.format."),
            (re.compile(r"^response_format"), "text.format"),
            (re.compile(r"^(tools\[\d+\])\.function\."), r"\1."),
            (re.compile(r"^tool_choice\.function\."), "tool_choice."),
            (re.compile(r"^max_completion_tokens$|^max_tokens$"), "max_output_tokens"),
            (re.compile(r"^reasoning_effort$"), "reasoning.effort"),
            (re.compile(r"^messages(\[\d+\])?"), "input"))


_MESSAGE_RENAMES = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                    ("max_tokens", "max_output_tokens"))


def _responses_param(exc: InvalidRequestError) -> InvalidRequestError:
    """The chat validator's error with the Responses field names (param and message)."""
    param, message = exc.param, exc.message
    if param is None:
        return exc
    for pattern, repl in _RENAMES:
        new = pattern.sub(repl, param)
        if new != param:
            message = message.replace(param, new)
            for old_name, new_name in _MESSAGE_RENAMES:
                message = message.replace(old_name, new_name)
            return type(exc)(message, param=new, code=exc.code)
    return exc


def parse_responses_request(body: dict[str, Any], prior_items: list[dict[str, Any]], *,
                            vocab_size: int | None = None,
                            resolve: ItemResolver | None = None) -> ResponsesRequest:
    """Validate a Responses body (OpenAI "Create a model response").

    Args:
        body: the decoded JSON object.
        prior_items: the conversation so far (a ``previous_response_id``'s input and output items);
            [] for a new conversation.
        vocab_size: when given, token ids in ``logit_bias`` / ``stop_token_ids`` are range-checked.
        resolve: item id -> stored item, for ``item_reference`` input items (``ResponseStore.item``);
            None: every item reference is a 400 (``input[i].id``: not found).

    Raises:
        InvalidRequestError: with ``param`` naming the Responses field.
    """
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) not in (None, False):
            raise _bad(name, f"'{name}' is not supported by this server.")
    if body.get("truncation") not in (None, "disabled"):
        raise _bad("truncation", "Only truncation 'disabled' is supported: a conversation longer than the "
                   "context is a 400, never cut silently.")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions", f"'instructions' must be a string, not {_type_name(instructions)}.")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in metadata.items())):
        raise _bad("metadata", "'metadata' must be an object of at most 16 string values (keys of at "
                   "most 64 characters, values of at most 512), as OpenAI's.")
    for name, limit in ECHOED_STRINGS.items():
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise _bad(name, f"'{name}' must be a string, not {_type_name(value)}.")
        if value is not None and limit is not None and len(value) > limit:
            raise _bad(name, f"'{name}' must be at most {limit} characters; got {len(value)}.")
    include = body.get("include") or []
    if not isinstance(include, list):
        raise _bad("include", f"'include' must be an array, not {_type_name(include)}.")
    for i, value in enumerate(include):
        if value not in INCLUDABLE:
            raise _bad(f"include[{i}]",
                       f"'include[{i}]' must be one of {', '.join(INCLUDABLE)}; got {value!r}.")
    items = prior_items + input_items(body, resolve)
    chat: dict[str, Any] = {k: body[k] for k in _PASSTHROUGH if k in body}
    chat.update(model=body.get("model"), messages=chat_messages(items, instructions, len(prior_items)),
                stream=body.get("stream"))
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    fmt = response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    include_logprobs = LOGPROBS_INCLUDE in include
    if include_logprobs:
        chat["logprobs"] = True
        if body.get("top_logprobs") is not None:
            chat["top_logprobs"] = body["top_logprobs"]
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise _bad("store", f"'store' must be a boolean, not {_type_name(store)}.")
    try:
        parsed = parse_chat_request(chat, max_n=1, vocab_size=vocab_size)
    except InvalidRequestError as exc:
        raise _responses_param(exc) from None
    return ResponsesRequest(parsed, items, body, store, include_logprobs)
