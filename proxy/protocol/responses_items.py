"""Responses API input items -> chat messages (the rules: ``proxy.protocol.responses_request``)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from .fields import _bad, _type_name
from .images import ImagePart, responses_image

ROLES = ("user", "system", "developer", "assistant")
ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
"""The prefix of the id an input item without one is given, by ``type`` (OpenAI's ``msg_``, ``fc_``, ...)."""

TEXT_PART_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
"""Content part types whose ``text`` is read as text (input, output, reasoning and summary parts)."""

ItemResolver = Callable[[str], dict[str, Any] | None]
"""Item id -> the stored item with that id, or None (unknown, evicted, or nothing is stored)."""


def _with_id(item: dict[str, Any]) -> dict[str, Any]:
    if isinstance(item.get("id"), str) and item["id"]:
        return item
    kind = item.get("type", "message")
    prefix = ID_PREFIXES.get(kind, "item") if isinstance(kind, str) else "item"
    return {**item, "id": f"{prefix}_{uuid.uuid4().hex}"}


def _resolved(item: dict[str, Any], i: int, resolve: ItemResolver | None) -> dict[str, Any]:
    """The stored item an ``item_reference`` names (a copy), as if it had been sent inline."""
    item_id, p = item.get("id"), f"input[{i}].id"
    if not isinstance(item_id, str) or not item_id:
        raise _bad(p, f"'{p}' must be the id string of a stored item, not {_type_name(item_id)}.")
    found = resolve(item_id) if resolve is not None else None
    if found is None:
        raise _bad(p, f"Item with id '{item_id}' not found: no stored response of this server holds it "
                   "(store: false, evicted, another replica, or before a restart).")
    return dict(found)


def _reasoning_texts(item: dict[str, Any], p: str) -> list[str]:
    """A reasoning item's text parts: its ``content`` (the reasoning itself) when it has any, else
    its ``summary``. Our own reasoning items carry the same text in both (the summary is the
    reasoning), so reading both would double it when the item is sent back."""
    texts: dict[str, list[str]] = {}
    for field in ("content", "summary"):
        parts = item.get(field)
        if parts is None:
            parts = []
        if not isinstance(parts, list):
            raise _bad(f"{p}.{field}", f"'{p}.{field}' must be an array of parts, not {_type_name(parts)}.")
        texts[field] = [part["text"] for part in parts
                        if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return texts["content"] or texts["summary"]


def input_items(body: dict[str, Any], resolve: ItemResolver | None = None) -> list[dict[str, Any]]:
    """``input`` as a list of item dicts (a string is one user message), each with an ``id``.

    An item without an ``id`` string is given a fresh unique one (``msg_<hex>``, ``fc_<hex>``, ...),
    which the stored response keeps (``GET /v1/responses/{id}/input_items``, ``item_reference``).
    An ``{"type": "item_reference", "id"}`` item is replaced by the stored item with that id (as
    OpenAI resolves it), so that it then counts exactly as the same item sent inline.

    Args:
        body: the request body.
        resolve: item id -> stored item (``ResponseStore.item``); None: no item can be referenced.

    Raises:
        InvalidRequestError: ``input`` is missing, empty, or not a string or an array of objects;
            an item reference's id is not a string or names no stored item (``input[i].id``).
    """
    value = body.get("input")
    if isinstance(value, str):
        return [_with_id({"type": "message", "role": "user", "content": value})]
    if value is None:
        raise _bad("input", "'input' is required.")
    if not isinstance(value, list):
        raise _bad("input", f"'input' must be a string or an array of items, not {_type_name(value)}.")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _bad(f"input[{i}]", f"'input[{i}]' must be an object, not {_type_name(item)}.")
        out.append(_resolved(item, i, resolve) if item.get("type") == "item_reference" else _with_id(item))
    return out


def _text(content: Any, p: str) -> str | list[dict[str, Any] | ImagePart]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(p, f"'{p}' must be a string or an array of content parts, not {_type_name(content)}.")
    parts: list[dict[str, Any] | ImagePart] = []
    for j, part in enumerate(content):
        q = f"{p}[{j}]"
        if not isinstance(part, dict):
            raise _bad(q, f"'{q}' must be an object, not {_type_name(part)}.")
        kind = part.get("type")
        if kind in TEXT_PART_TYPES:
            if not isinstance(part.get("text"), str):
                raise _bad(f"{q}.text", f"'{q}.text' must be a string.")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            parts.append(responses_image(part, q))
        elif kind in ("input_file", "input_audio", "refusal"):
            raise _bad(f"{q}.type", f"Content part type '{kind}' is not supported by this server; only text "
                       "and images are.")
        else:
            raise _bad(f"{q}.type", f"'{q}.type' must be 'input_text', 'output_text' or 'input_image'; "
                       f"got {kind!r}.")
    return parts


def _call(item: dict[str, Any], p: str) -> dict[str, Any]:
    name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise _bad(f"{p}.name", f"'{p}.name' is required for a function_call item.")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{p}.call_id", f"'{p}.call_id' is required for a function_call item.")
    if not isinstance(args, str):
        raise _bad(f"{p}.arguments", f"'{p}.arguments' must be a JSON string, not {_type_name(args)}.")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def chat_messages(items: list[dict[str, Any]], instructions: str | None,
                  num_prior: int = 0) -> list[dict[str, Any]]:
    """The chat ``messages`` of Responses input items (the module docstring's rules).

    Args:
        items: the conversation's items: ``num_prior`` items of a ``previous_response_id`` first,
            then this request's ``input``.

    Raises:
        InvalidRequestError: a malformed item, naming ``input[i]...`` with ``i`` its index in this
            request's ``input`` (the prior items were validated by the request that stored them).
    """
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning: list[str] = []
    call_ids: set[str] = set()
    for i, item in enumerate(items):
        p = f"input[{i - num_prior}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _bad(f"{p}.role", f"'{p}.role' must be one of {', '.join(ROLES)}; got {role!r}.")
            msg: dict[str, Any] = {"role": role, "content": _text(item.get("content"), f"{p}.content")}
            if role == "assistant" and reasoning:
                msg["reasoning_content"] = "".join(reasoning)
                reasoning = []
            out.append(msg)
        elif kind == "function_call":
            call = _call(item, p)
            call_ids.add(call["id"])
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning:
                    out[-1]["reasoning_content"], reasoning = "".join(reasoning), []
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"{p}.call_id", f"'{p}.call_id' is required for a function_call_output item.")
            if call_id not in call_ids:  # as OpenAI answers
                raise _bad(f"{p}.call_id",
                           f"No tool call found for function call output with call_id {call_id!r}.")
            text = output if isinstance(output, str) else _text(output, f"{p}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            reasoning.extend(_reasoning_texts(item, p))
        else:
            raise _bad(f"{p}.type", f"Input item type {kind!r} is not supported; use 'message', "
                       "'function_call', 'function_call_output', 'reasoning' or 'item_reference'.")
    return out
