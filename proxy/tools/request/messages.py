"""The messages of an agent loop for the chat template: assistant ``tool_calls`` and ``tool``
messages with ``tool_call_id``, validated, in the shape the template (or the prompt) needs."""

from __future__ import annotations

import json
from typing import Any

from proxy.tools.parsers import format_calls
from proxy.tools.request.field_errors import bad_field

__all__ = ["template_messages"]


def template_messages(
    messages: list[dict[str, Any]],
    raw: list[Any],
    *,
    template_has_tools: bool,
    call_format: str | None = None,
) -> list[dict[str, Any]]:
    """Messages for the chat template, with the tool parts of ``raw`` (the request's messages) added.

    Args:
        messages: the validated ``{"role", "content"}`` messages, in order (one per raw message);
            ``content`` of an assistant message with tool calls may be "" (OpenAI sends null).
        raw: the request's ``messages`` array, for ``tool_calls`` and ``tool_call_id``.
        template_has_tools: the template renders ``tool_calls`` and ``tool`` messages itself.
        call_format: for a template without tool support, the parser whose format earlier calls
            are written in (what :func:`tool_system_prompt` taught for ``auto``); None: the JSON
            array that ``required`` asks for.

    Returns:
        New message dicts: assistant ``tool_calls`` with ``function.arguments`` as objects (what
        transformers' templates expect; arguments that are not JSON, as a call cut by ``max_tokens``
        leaves them, stay the string they were, as OpenAI accepts them), ``tool`` messages with
        ``tool_call_id`` (and ``name`` when
        known). For a template without tool support, an assistant's calls are written into its
        content (``call_format``'s text, else a JSON array), and ``content`` is always a string
        (templates concatenate it).

    Raises:
        InvalidRequestError: a malformed ``tool_calls`` entry, or a ``tool`` message without
            ``tool_call_id``.
    """
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, (msg, src) in enumerate(zip(messages, raw)):
        msg = dict(msg)
        p = f"messages[{i}]"
        if msg.get("content") is None:
            msg["content"] = ""
        if msg["role"] == "assistant" and src.get("tool_calls"):
            calls = _tool_calls(src["tool_calls"], f"{p}.tool_calls")
            for c in calls:
                names[c["id"]] = c["function"]["name"]
            if template_has_tools:
                msg["tool_calls"] = calls
            else:
                pairs = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
                text = (format_calls(call_format, pairs) if call_format is not None else
                        json.dumps([{"name": n, "parameters": a} for n, a in pairs], ensure_ascii=False))
                msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + text
        elif msg["role"] == "tool":
            call_id = src.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_field(f"{p}.tool_call_id", f"'{p}.tool_call_id' is required for role 'tool'.")
            msg["tool_call_id"] = call_id
            if call_id in names:
                msg.setdefault("name", names[call_id])
        out.append(msg)
    return out


def _tool_calls(value: Any, p: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad_field(p, f"'{p}' must be an array.")
    calls = []
    for j, call in enumerate(value):
        q = f"{p}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise bad_field(q, f"'{q}' must be an object with 'function'.")
        fn = call["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_field(f"{q}.function.name", f"'{q}.function.name' is required.")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # a call max_tokens cut (OpenAI accepts any string): the template gets the text
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_field(f"{q}.id", f"'{q}.id' must be a string.")
        calls.append({"id": call_id or f"call_{j}", "type": "function",
                      "function": {"name": name, "arguments": args}})
    return calls
