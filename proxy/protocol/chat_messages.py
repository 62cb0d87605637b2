"""A chat body's ``messages`` -> the template's messages and the request's images, validated.

Rules (OpenAI "Create chat completion"; the separator is vLLM's):

- ``content`` is a string or an array of parts: ``text`` parts are joined with a newline (OpenAI does
  not document a separator; joining with nothing glued words of consecutive parts together);
  ``image_url`` parts (:func:`proxy.protocol.images.chat_image`) are allowed in ``user`` messages only,
  as OpenAI allows them; a message with images gets the list content vision templates read
  (:func:`proxy.protocol.images.template_content`).
- An already validated :class:`~proxy.protocol.images.ImagePart` object is accepted as a part: the
  Responses and Messages translations put their images into the chat body that way (JSON never
  produces one), so each keeps the ``param`` of its own wire format.
- ``developer`` is given to the template as ``system``; ``function`` and ``audio`` are refused.
"""

from __future__ import annotations

from typing import Any

from .fields import _bad, _type_name
from .images import ImagePart, chat_image, template_content

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _content(value: Any, param: str, role: str, images: list[ImagePart]) -> str | list[dict[str, Any]]:
    """``content`` at ``param`` -> the template's content; its images are appended to ``images``."""
    if isinstance(value, str):
        return value
    if value is None:
        raise _bad(param, f"'{param}' is required for role '{role}'.")
    if not isinstance(value, list):
        raise _bad(
            param, f"'{param}' must be a string or an array of content parts, not {_type_name(value)}."
        )
    if not value and role != "assistant":  # as OpenAI (an assistant's may be empty beside its calls)
        raise _bad(param,
                   f"'{param}' must not be an empty array: send a string or at least one content part.")
    parts: list[str | ImagePart] = []
    for j, part in enumerate(value):
        p = f"{param}[{j}]"
        image = part if isinstance(part, ImagePart) else None
        if image is None and not isinstance(part, dict):
            raise _bad(p, f"'{p}' must be an object, not {_type_name(part)}.")
        kind = "image_url" if image is not None else part.get("type")
        if kind == "image_url":
            if role != "user":
                where = image.param if image is not None else p
                raise _bad(where, f"'{where}' is an image, but images are only allowed in user messages "
                           f"(this one is role '{role}').")
            image = image if image is not None else chat_image(part, p)
            images.append(image)
            parts.append(image)
            continue
        if kind != "text":
            if isinstance(kind, str):
                raise _bad(f"{p}.type", f"Content part type '{kind}' is not supported; only 'text' and "
                           "'image_url' are.")
            raise _bad(f"{p}.type", f"'{p}.type' must be 'text' or 'image_url'.")
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad(f"{p}.text", f"'{p}.text' must be a string, not {_type_name(text)}.")
        parts.append(text)
    return template_content(parts)


def chat_messages(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], tuple[ImagePart, ...]]:
    """``(template messages, images in prompt order)`` of a chat body's ``messages``.

    Raises:
        InvalidRequestError: a malformed message or part, naming it (``messages[1].content[0].type``).
    """
    if "messages" not in body or body["messages"] is None:
        raise _bad("messages", "'messages' is required.")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise _bad("messages", f"'messages' must be an array, not {_type_name(messages)}.")
    if not messages:
        raise _bad("messages", "'messages' must contain at least one message.")
    out = []
    images: list[ImagePart] = []
    for i, message in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(p, f"'{p}' must be an object, not {_type_name(message)}.")
        role = message.get("role")
        if role is None:
            raise _bad(f"{p}.role", f"'{p}.role' is required.")
        if not isinstance(role, str):
            raise _bad(f"{p}.role", f"'{p}.role' must be a string, not {_type_name(role)}.")
        if role == "function":
            raise _bad(f"{p}.role", "Role 'function' is deprecated and not supported; use 'tool'.")
        if role not in CHAT_ROLES:
            raise _bad(f"{p}.role", f"'{p}.role' must be one of {', '.join(CHAT_ROLES)}; got {role!r}.")
        for unsupported in ("function_call", "audio"):
            if message.get(unsupported) not in (None, []):
                raise _bad(f"{p}.{unsupported}", f"'{p}.{unsupported}' is not supported by this server.")
        if message.get("tool_calls") not in (None, []) and role != "assistant":
            raise _bad(f"{p}.tool_calls", f"'{p}.tool_calls' is only allowed on assistant messages.")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(f"{p}.name", f"'{p}.name' must be a string, not {_type_name(name)}.")
        content: str | list[dict[str, Any]]
        if role == "assistant" and message.get("content") is None and message.get("tool_calls"):
            content = ""  # the ordinary agent loop: a call without text (templates need a string)
        else:
            content = _content(message.get("content"), f"{p}.content", role, images)
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return tuple(out), tuple(images)
