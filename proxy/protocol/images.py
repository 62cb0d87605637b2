"""Image parts of every wire format -> one typed value, :class:`ImagePart`.

The shapes read here, each checked for its structure only (the bytes are fetched and decoded later,
by ``proxy.media``, once the served model is known to read images):

- Chat Completions (OpenAI "Create chat completion", user messages):
  ``{"type": "image_url", "image_url": {"url": str, "detail": "auto" | "low" | "high"}}``.
- Responses (OpenAI "Create a model response"): ``{"type": "input_image", "image_url": str,
  "detail": ...}``; ``file_id`` is a 400 by name (no Files API here).
- Anthropic Messages ("Vision" guide): ``{"type": "image", "source": {"type": "base64",
  "media_type": "image/jpeg" | "image/png" | "image/gif" | "image/webp", "data": str}}`` (made a
  ``data:`` URL) or ``{"source": {"type": "url", "url": str}}``; ``source.type: "file"`` is a 400 by
  name.

A URL is a ``data:`` URL, ``http(s)://`` or ``file://`` (what vLLM accepts); any other scheme is a
400 naming the part's ``url``. ``detail`` is accepted and does not change the input: the model's
own processor sets the resolution an image is seen at (vLLM also ignores it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fields import _bad, _type_name

URL_SCHEMES = ("data:", "http://", "https://", "file://")
"""The URL forms an image may come as (matched case-insensitively)."""
DETAILS = ("auto", "low", "high")
"""OpenAI's ``detail`` values."""
ANTHROPIC_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
"""``source.media_type`` values Anthropic accepts for a base64 image."""


@dataclass(frozen=True)
class ImagePart:
    """One image of a request, in the order its prompt shows the images.

    Attributes:
        param: the part's field in the request as sent (``messages[0].content[1]``,
            ``input[2].content[0]``); every error about this image names it.
        url: a ``data:``, ``http(s)://`` or ``file://`` URL.
        detail: OpenAI's ``detail`` (``auto`` / ``low`` / ``high``), or None when not sent.
    """

    param: str
    url: str
    detail: str | None = None


def _url(value: Any, p: str) -> str:
    if not isinstance(value, str) or not value:
        raise _bad(p, f"'{p}' must be a non-empty URL string, not {_type_name(value)}.")
    if not value[:8].lower().startswith(URL_SCHEMES):
        scheme = value.split(":", 1)[0][:20] if ":" in value else value[:20]
        raise _bad(p, f"'{p}' must be a data: URL, an http(s):// URL or a file:// URL; got {scheme!r}...")
    return value


def _detail(part: dict[str, Any], p: str) -> str | None:
    detail = part.get("detail")
    if detail is not None and detail not in DETAILS:
        raise _bad(f"{p}.detail", f"'{p}.detail' must be one of {', '.join(DETAILS)}; got {detail!r}.")
    return detail if isinstance(detail, str) else None


def chat_image(part: dict[str, Any], p: str) -> ImagePart:
    """A chat ``image_url`` content part at ``p`` (``messages[i].content[j]``) -> its :class:`ImagePart`.

    Raises:
        InvalidRequestError: ``image_url`` is not an object with a ``url`` string of an accepted
            scheme, or ``detail`` is not ``auto`` / ``low`` / ``high`` (naming the field).
    """
    image = part.get("image_url")
    if not isinstance(image, dict):
        raise _bad(f"{p}.image_url",
                   f"'{p}.image_url' must be an object with a 'url', not {_type_name(image)}.")
    return ImagePart(p, _url(image.get("url"), f"{p}.image_url.url"), _detail(image, f"{p}.image_url"))


def responses_image(part: dict[str, Any], p: str) -> ImagePart:
    """A Responses ``input_image`` part at ``p`` (``input[i].content[j]``) -> its :class:`ImagePart`.

    Raises:
        InvalidRequestError: a ``file_id`` (no Files API: named), no ``image_url``, a URL of another
            scheme, or a bad ``detail``.
    """
    if part.get("file_id") is not None:
        raise _bad(f"{p}.file_id", f"'{p}.file_id' is not supported: this server has no Files API; send the "
                   "image as 'image_url' (a data: or http(s) URL).")
    return ImagePart(p, _url(part.get("image_url"), f"{p}.image_url"), _detail(part, p))


def anthropic_image(block: dict[str, Any], p: str, param: str | None = None) -> ImagePart:
    """An Anthropic ``image`` block at ``p`` (``messages[i].content[j]``) -> its :class:`ImagePart`,
    whose ``param`` is ``param`` when given (else ``p``). A base64 source becomes a ``data:`` URL.

    Raises:
        InvalidRequestError: ``source`` missing or of another type (``file``: named), a base64
            source without ``data`` or with a ``media_type`` Anthropic does not accept.
    """
    source = block.get("source")
    s = f"{p}.source"
    if not isinstance(source, dict):
        raise _bad(s, f"'{s}' must be an object, not {_type_name(source)}.")
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in ANTHROPIC_MEDIA_TYPES:
            raise _bad(f"{s}.media_type", f"'{s}.media_type' must be one of "
                       f"{', '.join(ANTHROPIC_MEDIA_TYPES)}; got {media_type!r}.")
        if not isinstance(data, str) or not data:
            raise _bad(f"{s}.data", f"'{s}.data' must be a non-empty base64 string.")
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        url = _url(source.get("url"), f"{s}.url")
    elif kind == "file":
        raise _bad(f"{s}.type", f"'{s}.type' 'file' is not supported: this server has no Files API; send "
                   "a 'base64' or 'url' source.")
    else:
        raise _bad(f"{s}.type", f"'{s}.type' must be 'base64' or 'url'; got {kind!r}.")
    return ImagePart(param or p, url)


def template_content(parts: list[str | ImagePart]) -> str | list[dict[str, Any]]:
    """A message's text and images -> its chat-template ``content``: the text (parts joined with a
    newline, as text parts always are) when there is no image, else the parts in order as
    ``{"type": "text", "text"}`` (consecutive texts joined) and ``{"type": "image"}`` entries, the
    form the chat templates of transformers' vision processors read."""
    if all(isinstance(part, str) for part in parts):
        return "\n".join(part for part in parts if isinstance(part, str))
    out: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, ImagePart):
            out.append({"type": "image"})
        elif out and out[-1]["type"] == "text":
            out[-1]["text"] += "\n" + part
        else:
            out.append({"type": "text", "text": part})
    return out
