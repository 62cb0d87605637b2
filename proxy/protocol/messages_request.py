"""``POST /v1/messages`` bodies (Anthropic "Messages") -> the chat request they mean.

The Anthropic Messages API is served by the same pipeline as Chat Completions, as the Responses API
is (``proxy.protocol.responses_request``): the body is translated into the equivalent chat body,
which :func:`parse_chat_request` validates; every error names the Messages field
(``tools[0].input_schema``, ``stop_sequences``, ``messages[2].content[1].tool_use_id``), never the
chat one.

Translation (Anthropic "Messages" reference, "Tool use", "Extended thinking"):

- ``system`` / ``messages``: :mod:`proxy.protocol.messages_content`.
- ``max_tokens`` (required, >= 1): the output budget; a value above what the context leaves is
  lowered to it by the route (Claude Code always sends 32000), see :attr:`MessagesRequest.max_tokens`.
- ``stop_sequences`` -> ``stop``; ``temperature`` (Anthropic's range [0, 1]), ``top_p``, ``top_k``
  as they are; ``metadata.user_id`` -> ``user``.
- ``tools``: custom tools ``{name, description, input_schema}`` (``type`` absent or ``custom``;
  ``cache_control`` ignored) -> chat function tools; a server tool (any other ``type``:
  ``web_search_20250305``, ``bash_20250124``, ``text_editor_*``, ``code_execution_*`` ...) is a 400
  naming its type.
- ``tool_choice``: ``auto`` -> ``auto``; ``any`` -> ``required`` (grammar-enforced); ``tool`` ->
  the named function (grammar-enforced); ``none`` -> ``none``; ``disable_parallel_tool_use`` ->
  ``parallel_tool_calls: false``.
- ``thinking``: ``enabled`` (``budget_tokens`` >= 1024 and < ``max_tokens``, as Anthropic checks
  them) and ``adaptive`` -> the template's thinking on (``enable_thinking: true``); ``disabled`` ->
  off (``reasoning_effort: "none"``); absent: the model's default. ``display: "omitted"`` sends
  thinking blocks with their ``signature`` and no text (``summarized``: the whole thinking, as no
  summarizer runs here). ``budget_tokens`` is enforced: it becomes vLLM's
  ``thinking_token_budget`` (:class:`proxy.sampling.ThinkingBudget`): after that many thinking
  tokens the reasoning parser's end marker is forced and the answer follows. On a model without a
  reasoning parser (or harmony's, which has no end tag to force) ``enabled`` is a 400 naming
  ``thinking.budget_tokens``, as Anthropic refuses thinking on a model without it; ``adaptive``
  there only switches the template (no budget to honour).
- ``output_config.effort`` (``low`` / ``medium`` / ``high``; ``max`` -> ``high``) ->
  ``reasoning_effort``; ``output_config.format`` ``{type: "json_schema", schema}`` ->
  ``response_format`` (grammar-enforced).
- A last message from the ``assistant`` is a prefill: the output continues it (the template renders
  it open, ``continue_final_message``); one that ends with ``tool_use`` is a 400.
- ``context_management``: its edits validated here (:mod:`proxy.protocol.messages_context`) and
  applied by the route before the body is translated (they need token counts).
- Refused by name (400): ``container``, non-empty ``mcp_servers``. Accepted and ignored:
  ``service_tier``, ``inference_geo``, ``speed``, unknown fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from proxy.errors import InvalidRequestError

from .fields import _bad, _opt_int, _opt_number, _type_name, array_of_objects
from .messages_content import chat_messages
from .messages_context import ContextEdit, parse_context_management
from .requests import ChatCompletionRequest, parse_chat_request

THINKING_TYPES = ("enabled", "adaptive", "disabled")
THINKING_DISPLAYS = ("summarized", "omitted")
MIN_THINKING_BUDGET = 1024
"""Anthropic's smallest ``thinking.budget_tokens``."""
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "high"}
REFUSED_FIELDS = ("container",)
"""Fields whose non-null values this server cannot honour (a 400 naming the field)."""


@dataclass(frozen=True)
class MessagesRequest:
    """A validated Messages body.

    Attributes:
        chat: the equivalent chat request, with ``max_tokens`` None (the route lowers
            :attr:`max_tokens` to what the context leaves).
        max_tokens: the requested ``max_tokens`` (None for ``count_tokens``, which has none).
        stop_sequences: ``stop_sequences`` (to report which one ended the output).
        paths: the Anthropic path of each chat message (``system``, ``messages[i]``), to rename errors.
        body: the body as sent.
        prefill: the last message is the assistant's: the output continues it (Anthropic's
            "prefill"), rendered with ``continue_final_message``.
        omit_thinking: ``thinking.display`` is ``omitted``: thinking blocks keep their ``signature``
            and carry no text (no ``thinking_delta`` is streamed).
        context_edits: the ``context_management`` edits, in order (not yet applied).
    """

    chat: ChatCompletionRequest
    max_tokens: int | None
    stop_sequences: tuple[str, ...]
    paths: tuple[str, ...]
    body: dict[str, Any]
    prefill: bool = False
    omit_thinking: bool = False
    context_edits: tuple[ContextEdit, ...] = ()


SAMPLING_EXTRAS = ("seed", "ignore_eos", "min_tokens", "min_p", "repetition_penalty", "stop_token_ids")
"""vLLM's sampling extras (not Anthropic fields) a Messages body may carry, as on chat completions."""


def chat_tools(value: Any) -> list[dict[str, Any]]:
    """Anthropic custom tools -> chat function ``tools``.

    Raises:
        InvalidRequestError: not an array, a server tool (its type named), or a malformed tool.
    """
    out = []
    for p, tool in array_of_objects(value, "tools"):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise _bad(f"{p}.type", f"Server tool {kind!r} is not supported by this server; only custom "
                       "tools (with 'name' and 'input_schema') are.")
        if not isinstance(tool.get("input_schema"), dict):
            raise _bad(f"{p}.input_schema",
                       f"'{p}.input_schema' is required and must be a JSON Schema object.")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any, chat: dict[str, Any]) -> None:
    """``tool_choice`` -> chat ``tool_choice`` and ``parallel_tool_calls`` (into ``chat``)."""
    if not isinstance(value, dict):
        raise _bad("tool_choice", f"'tool_choice' must be an object, not {_type_name(value)}.")
    kind = value.get("type")
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise _bad("tool_choice.name", "'tool_choice.name' is required for tool_choice type 'tool'.")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif isinstance(kind, str) and kind in TOOL_CHOICES:
        chat["tool_choice"] = TOOL_CHOICES[kind]
    else:
        raise _bad("tool_choice.type", f"'tool_choice.type' must be one of 'auto', 'any', 'tool', 'none'; "
                   f"got {kind!r}.")
    disable = value.get("disable_parallel_tool_use")
    if disable is not None:
        if not isinstance(disable, bool):
            raise _bad("tool_choice.disable_parallel_tool_use",
                       "'tool_choice.disable_parallel_tool_use' must be a boolean.")
        chat["parallel_tool_calls"] = not disable


def _thinking(value: Any, max_tokens: int | None, chat: dict[str, Any]) -> bool:
    """``thinking`` -> the template's thinking switch (into ``chat``); returns whether the thinking
    text is omitted from the response (``display: "omitted"``)."""
    if value is None:
        return False
    if not isinstance(value, dict):
        raise _bad("thinking", f"'thinking' must be an object, not {_type_name(value)}.")
    display = value.get("display")
    if display is not None and display not in THINKING_DISPLAYS:
        raise _bad("thinking.display", f"'thinking.display' must be one of {', '.join(THINKING_DISPLAYS)}; "
                   f"got {display!r}.")
    kind = value.get("type")
    if kind not in THINKING_TYPES:
        raise _bad("thinking.type",
                   f"'thinking.type' must be one of {', '.join(THINKING_TYPES)}; got {kind!r}.")
    if kind == "disabled":
        chat["chat_template_kwargs"] = {"enable_thinking": False}
        chat["reasoning_effort"] = "none"
        return False
    chat["chat_template_kwargs"] = {"enable_thinking": True}
    if kind == "enabled":
        try:
            budget = _opt_int(value, "budget_tokens", None, lo=MIN_THINKING_BUDGET)
        except InvalidRequestError as exc:
            raise _bad("thinking.budget_tokens", exc.message.replace("'budget_tokens'",
                                                                    "'thinking.budget_tokens'")) from None
        if budget is None:
            raise _bad("thinking.budget_tokens", "'thinking.budget_tokens' is required for thinking type "
                       "'enabled'.")
        if max_tokens is not None and budget >= max_tokens:
            raise _bad("thinking.budget_tokens", f"'thinking.budget_tokens' ({budget}) must be less than "
                       f"'max_tokens' ({max_tokens}).")
        chat["thinking_token_budget"] = budget  # enforced: the end marker is forced at the budget
    return display == "omitted"


def _output_config(value: Any, chat: dict[str, Any]) -> None:
    """``output_config`` (``effort``, ``format``) -> ``reasoning_effort`` / ``response_format``."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise _bad("output_config", f"'output_config' must be an object, not {_type_name(value)}.")
    effort = value.get("effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in EFFORTS:
            raise _bad("output_config.effort", f"'output_config.effort' must be one of {', '.join(EFFORTS)}; "
                       f"got {effort!r}.")
        chat.setdefault("reasoning_effort", EFFORTS[effort])
    fmt = value.get("format")
    if fmt is None:
        return
    schema = fmt.get("schema") if isinstance(fmt, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(schema, dict):
        raise _bad("output_config.format",
                   "'output_config.format' must be {'type': 'json_schema', 'schema': {...}}.")
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def _metadata(value: Any, chat: dict[str, Any]) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise _bad("metadata", f"'metadata' must be an object, not {_type_name(value)}.")
    user = value.get("user_id")
    if user is not None and not isinstance(user, str):
        raise _bad("metadata.user_id", f"'metadata.user_id' must be a string, not {_type_name(user)}.")
    if user is not None:
        chat["user"] = user


_RENAMES = ((re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
            (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
            (re.compile(r"^tool_choice\.function\."), "tool_choice."),
            (re.compile(r"^parallel_tool_calls$"), "tool_choice.disable_parallel_tool_use"),
            (re.compile(r"^stop$"), "stop_sequences"),
            (re.compile(r"^response_format(\.json_schema)?"), "output_config.format"),
            (re.compile(r"^reasoning_effort$"), "output_config.effort"),
            (re.compile(r"^chat_template_kwargs$"), "thinking"),
            (re.compile(r"^thinking_token_budget$"), "thinking.budget_tokens"),
            (re.compile(r"^user$"), "metadata.user_id"))
_MESSAGE_RENAMES = (("'parallel_tool_calls'", "'tool_choice.disable_parallel_tool_use'"),
                    ("required' or a named function", "any' or a named tool"))


def messages_param(exc: InvalidRequestError, paths: tuple[str, ...]) -> InvalidRequestError:
    """The chat pipeline's error with the Messages field names (param and message): chat message
    ``messages[k]`` -> ``paths[k]`` (the Anthropic message or ``system`` it came from), tool and
    sampling fields -> their Messages names. Other errors are returned as they are."""
    param, message = exc.param, exc.message
    for old, new in _MESSAGE_RENAMES:
        message = message.replace(old, new)
    if param is not None:
        found = re.match(r"^messages\[(\d+)\]", param)
        if found and int(found.group(1)) < len(paths):
            new = paths[int(found.group(1))] + param[found.end():]
        else:
            new = param
            for pattern, repl in _RENAMES:
                new = pattern.sub(repl, new)
        message = message.replace(f"'{param}", f"'{new}")
        param = new
    if (param, message) == (exc.param, exc.message):
        return exc
    return type(exc)(message, param=param, code=exc.code)


def parse_messages_request(body: dict[str, Any], *, vocab_size: int | None = None,
                           count_only: bool = False) -> MessagesRequest:
    """Validate a Messages body (Anthropic "Create a Message"; with ``count_only``, "Count tokens in
    a Message", which has no ``max_tokens`` and no sampling fields).

    Raises:
        InvalidRequestError: with ``param`` naming the Messages field.
    """
    max_tokens = None
    if not count_only:
        if body.get("max_tokens") is None:
            raise _bad("max_tokens", "'max_tokens' is required.")
        max_tokens = _opt_int(body, "max_tokens", None, lo=1)
        _opt_number(body, "temperature", 1.0, 0.0, 1.0)
    for name in REFUSED_FIELDS:
        if body.get(name) is not None:
            raise _bad(name, f"'{name}' is not supported by this server.")
    if body.get("mcp_servers"):
        raise _bad("mcp_servers", "'mcp_servers' (the MCP connector: tools run by the server) is not "
                   "supported by this server; declare the tools as custom tools instead.")
    messages, paths = chat_messages(body.get("system"), body.get("messages"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    if not count_only:
        chat.update({k: body[k] for k in ("temperature", "top_p", "top_k", "stream", *SAMPLING_EXTRAS)
                     if k in body})
    stop = body.get("stop_sequences")
    if stop is not None:
        chat["stop"] = stop
    if body.get("tools"):
        chat["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
    omit_thinking = _thinking(body.get("thinking"), max_tokens, chat)
    _output_config(body.get("output_config"), chat)
    _metadata(body.get("metadata"), chat)
    try:
        parsed = parse_chat_request(chat, max_n=1, vocab_size=vocab_size)
    except InvalidRequestError as exc:
        raise messages_param(exc, tuple(paths)) from None
    last = messages[-1]
    prefill = last["role"] == "assistant"
    if prefill and last.get("tool_calls"):
        raise _bad(paths[-1], f"The last message ('{paths[-1]}') is an assistant turn with tool_use; send "
                   "its tool_result in a user message to continue.")
    return MessagesRequest(parsed, max_tokens, parsed.params.stop, tuple(paths), body, prefill, omit_thinking,
                           parse_context_management(body.get("context_management")))
