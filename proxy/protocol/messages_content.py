"""Anthropic Messages ``system`` and ``messages`` (content blocks) -> chat messages.

The rules (Anthropic "Messages" API reference, "Tool use" and "Extended thinking" guides), each a
translation into the chat message that means the same to the chat template:

- ``system``: a string, or an array of ``text`` blocks (joined with a newline, as chat joins text
  parts; ``cache_control`` accepted and ignored: the prefix cache here is automatic) -> a leading
  ``system`` message.
- a message's ``content``: a string, or an array of blocks:
  - ``text`` -> text of the message (consecutive text blocks joined with a newline);
  - ``tool_use`` (assistant) -> an entry of the assistant turn's ``tool_calls`` (``input`` -> the
    JSON ``arguments``, ``id`` kept);
  - ``tool_result`` (user) -> a ``tool`` message with ``tool_call_id`` = ``tool_use_id``; its content
    a string or ``text`` blocks; ``is_error: true`` prefixes the text with ``Error: `` (chat templates
    have no error flag, so the model reads it in the text);
  - ``thinking`` (assistant, sent back with its ``signature``) -> the turn's ``reasoning_content``
    (templates that render past thinking read it; most drop it); ``redacted_thinking`` is accepted
    and left out (its ``data`` is another provider's encrypted thinking: there is no text to render);
  - ``image`` (user) -> an image part of the user message (:func:`proxy.protocol.images.anthropic_image`;
    its ``param`` is made so that :func:`~proxy.protocol.messages_request.messages_param` turns it back
    into ``messages[i].content[j]``); elsewhere (assistant, ``system``, ``tool_result``) a 400;
  - ``document``, ``search_result``, ``server_tool_use``, ``web_search_tool_result``,
    ``container_upload`` ... -> a 400 naming the block type (no documents or server tools are served).
- ``role: "system"`` messages inside ``messages`` (Claude Code sends one last) -> a ``system``
  message at that place; the chat template decides how to render it.

Every error names the Anthropic field (``messages[2].content[0].type``, ``system[1].text``).
"""

from __future__ import annotations

import json
from typing import Any

from .fields import _bad, _type_name
from .images import ImagePart, anthropic_image

ROLES = ("user", "assistant", "system")
UNSUPPORTED_BLOCKS = ("document", "search_result", "container_upload", "server_tool_use",
                      "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                      "bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
                      "mcp_tool_use", "mcp_tool_result", "tool_search_tool_result", "tool_reference")
"""Content block types this server cannot serve: a 400 naming the type (no documents or server-side
tools)."""
ERROR_PREFIX = "Error: "
"""What a ``tool_result`` with ``is_error: true`` starts with in the rendered tool message."""


def _block_type(block: Any, p: str) -> str:
    if not isinstance(block, dict):
        raise _bad(p, f"'{p}' must be an object, not {_type_name(block)}.")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise _bad(f"{p}.type", f"'{p}.type' is required and must be a string.")
    if kind in UNSUPPORTED_BLOCKS:
        raise _bad(f"{p}.type", f"Content block type '{kind}' is not supported by this server; only "
                   "'text', 'image', 'tool_use', 'tool_result', 'thinking' and 'redacted_thinking' are.")
    return kind


def _string(block: dict[str, Any], key: str, p: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise _bad(f"{p}.{key}", f"'{p}.{key}' is required and must be a string, not {_type_name(value)}.")
    return value


def system_text(value: Any, param: str = "system") -> str | None:
    """``system`` (a string or ``text`` blocks) -> the system prompt text; None when absent or empty.
    ``param``: the field's name in errors (``messages[i].content`` for a ``system`` message).

    Raises:
        InvalidRequestError: not a string or an array of text blocks (naming ``system[i]...``).
    """
    if value is None or isinstance(value, str):
        return value or None
    if not isinstance(value, list):
        raise _bad(param, f"'{param}' must be a string or an array of text blocks, not {_type_name(value)}.")
    return _text_blocks(value, param, "") or None


def _text_blocks(blocks: list[Any], param: str, where: str) -> str:
    """The texts of ``text`` blocks joined with ``"\n"`` (``param[i]`` in errors; ``where`` ends the
    message of a block of another type, e.g. ``" in a tool_result"``)."""
    texts = []
    for i, block in enumerate(blocks):
        p = f"{param}[{i}]"
        kind = _block_type(block, p)
        if kind != "text":
            raise _bad(f"{p}.type", f"'{p}.type' must be 'text'{where}; got {kind!r}.")
        texts.append(_string(block, "text", p))
    return "\n".join(texts)


def _tool_result(block: dict[str, Any], p: str) -> dict[str, Any]:
    call_id = _string(block, "tool_use_id", p)
    content = block.get("content", "")
    if content is None:
        content = ""
    if isinstance(content, list):
        content = _text_blocks(content, f"{p}.content", " in a tool_result")
    elif not isinstance(content, str):
        raise _bad(f"{p}.content", f"'{p}.content' must be a string or an array of text blocks, not "
                   f"{_type_name(content)}.")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise _bad(f"{p}.is_error", f"'{p}.is_error' must be a boolean, not {_type_name(is_error)}.")
    text = ERROR_PREFIX + content if is_error else content
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tool_use(block: dict[str, Any], p: str) -> dict[str, Any]:
    call_id, name = _string(block, "id", p), _string(block, "name", p)
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise _bad(f"{p}.input", f"'{p}.input' must be an object, not {_type_name(args)}.")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _user_message(parts: list[str | ImagePart]) -> dict[str, Any]:
    """A user message of text and images: the text joined when there is no image, else chat parts
    (``text`` parts and the :class:`ImagePart` objects the chat validator takes as they are)."""
    if all(isinstance(part, str) for part in parts):
        return {"role": "user", "content": "\n".join(part for part in parts if isinstance(part, str))}
    content = [part if isinstance(part, ImagePart) else {"type": "text", "text": part} for part in parts]
    return {"role": "user", "content": content}


def _user_blocks(blocks: list[Any], p: str, base: int) -> list[dict[str, Any]]:
    """A user turn's blocks -> ``tool`` messages (its ``tool_result`` blocks) and user messages (its
    text and images), in the order sent; ``base``: the chat index of the first message made. An image
    at ``content[j]`` is named ``messages[k].content[j]`` with ``k`` its chat message's index, which
    ``messages_param`` renames to this message's path."""
    out: list[dict[str, Any]] = []
    parts: list[str | ImagePart] = []
    for j, block in enumerate(blocks):
        q = f"{p}.content[{j}]"
        kind = _block_type(block, q)
        if kind == "text":
            parts.append(_string(block, "text", q))
        elif kind == "image":
            parts.append(anthropic_image(block, q, f"messages[{base + len(out)}].content[{j}]"))
        elif kind == "tool_result":
            if parts:
                out.append(_user_message(parts))
                parts = []
            out.append(_tool_result(block, q))
        else:
            raise _bad(f"{q}.type", f"Content block type {kind!r} is not allowed in a user message; use "
                       "'text', 'image' or 'tool_result'.")
    if parts or not out:
        out.append(_user_message(parts))
    return out


def _assistant_blocks(blocks: list[Any], p: str) -> dict[str, Any]:
    """An assistant turn's blocks -> one assistant message (text, ``tool_calls``, ``reasoning_content``)."""
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        q = f"{p}.content[{j}]"
        kind = _block_type(block, q)
        if kind == "text":
            texts.append(_string(block, "text", q))
        elif kind == "tool_use":
            calls.append(_tool_use(block, q))
        elif kind == "thinking":
            thinking.append(_string(block, "thinking", q))
        elif kind != "redacted_thinking":
            raise _bad(f"{q}.type", f"Content block type {kind!r} is not allowed in an assistant message; "
                       "use 'text', 'tool_use', 'thinking' or 'redacted_thinking'.")
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    return msg


def chat_messages(system: Any, messages: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """``(chat messages, the Anthropic path of each)`` of a Messages body's ``system`` and ``messages``
    (the module docstring's rules). The paths (``system``, ``messages[3]``) rename errors the chat
    validator and the template raise about a chat message.

    Raises:
        InvalidRequestError: a malformed message or block, or an unsupported block type (named).
    """
    if messages is None:
        raise _bad("messages", "'messages' is required.")
    if not isinstance(messages, list):
        raise _bad("messages", f"'messages' must be an array, not {_type_name(messages)}.")
    if not messages:
        raise _bad("messages", "'messages' must contain at least one message.")
    out: list[dict[str, Any]] = []
    paths: list[str] = []
    prompt = system_text(system)
    if prompt is not None:
        out.append({"role": "system", "content": prompt})
        paths.append("system")
    for i, message in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(p, f"'{p}' must be an object, not {_type_name(message)}.")
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"{p}.role", f"'{p}.role' must be one of {', '.join(ROLES)}; got {role!r}.")
        content = message.get("content")
        if isinstance(content, str):
            converted = [{"role": role, "content": content}]
        elif not isinstance(content, list):
            raise _bad(f"{p}.content", f"'{p}.content' must be a string or an array of content blocks, not "
                       f"{_type_name(content)}.")
        elif role == "assistant":
            converted = [_assistant_blocks(content, p)]
        elif role == "user":
            converted = _user_blocks(content, p, len(out))
        else:
            converted = [{"role": "system", "content": system_text(content, f"{p}.content") or ""}]
        out += converted
        paths += [p] * len(converted)
    return out, paths
