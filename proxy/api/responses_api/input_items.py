"""``GET /v1/responses/{id}/input_items``: a stored response's input items in OpenAI's shapes, paged.

Items are stored as the client sent them (plus an ``id`` each, given at parse time when missing);
this module answers them as OpenAI lists them (openai-python ``ResponseItem``):

- a ``user`` / ``system`` / ``developer`` message -> ``{"type": "message", "id", "role", "status":
  "completed", "content": [{"type": "input_text", "text"}]}`` (a string content is one part);
- an ``assistant`` message -> the same with ``output_text`` parts (``"annotations": []``), as
  OpenAI's ``ResponseOutputMessage``;
- ``function_call`` -> ``{"type", "id", "call_id", "name", "arguments", "status"}``;
  ``function_call_output`` -> ``{"type", "id", "call_id", "output", "status"}``; ``reasoning`` ->
  ``{"type", "id", "summary", "content"?, "encrypted_content"?, "status"?}``.

Query parameters as OpenAI's: ``order`` ``asc`` / ``desc`` (default ``desc``: newest first), ``limit``
1-100 (default 20), ``after`` / ``before`` an item id of the list (items after / before it in that
order); a bad value is a 400 naming the parameter.
"""

from __future__ import annotations

from typing import Any

from proxy.errors import InvalidRequestError
from proxy.protocol.responses_items import TEXT_PART_TYPES

DEFAULT_LIMIT, MAX_LIMIT = 20, 100


def _parts(content: Any, assistant: bool) -> list[dict[str, Any]]:
    """Message content as OpenAI lists it: ``input_text`` parts (``output_text`` for an assistant)."""
    if isinstance(content, str):
        texts = [content]
    else:
        texts = [p["text"] for p in content or [] if isinstance(p, dict) and p.get("type") in TEXT_PART_TYPES
                 and isinstance(p.get("text"), str)]
    if assistant:
        return [{"type": "output_text", "text": t, "annotations": []} for t in texts]
    return [{"type": "input_text", "text": t} for t in texts]


def listed_item(item: dict[str, Any]) -> dict[str, Any]:
    """One stored input item in OpenAI's listed shape (the module docstring); every item has the
    ``id`` it was stored with."""
    kind = item.get("type", "message")
    status = item.get("status") or "completed"
    if kind == "message":
        role = item.get("role")
        return {"type": "message", "id": item["id"], "role": role, "status": status,
                "content": _parts(item.get("content"), role == "assistant")}
    if kind == "function_call":
        return {"type": kind, "id": item["id"], "call_id": item.get("call_id"), "name": item.get("name"),
                "arguments": item.get("arguments", "{}"), "status": status}
    if kind == "function_call_output":
        return {"type": kind, "id": item["id"], "call_id": item.get("call_id"), "output": item.get("output"),
                "status": status}
    if kind == "reasoning":
        out = {"type": kind, "id": item["id"], "summary": item.get("summary") or []}
        extra = ("content", "encrypted_content", "status")
        out.update({k: item[k] for k in extra if item.get(k) is not None})
        return out
    return dict(item)


def _limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequestError(f"'limit' must be an integer from 1 to {MAX_LIMIT}; got {value!r}.",
                                  param="limit")
    return limit


def _position(ids: list[str], item_id: str, param: str) -> int:
    try:
        return ids.index(item_id)
    except ValueError:
        raise InvalidRequestError(f"No input item with id '{item_id}' in this response's input items.",
                                  param=param) from None


def input_items_page(items: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any]:
    """The list object ``{"object": "list", "data", "first_id", "last_id", "has_more"}`` of one page
    of ``items`` (stored input items, oldest first) under the query parameters ``order``, ``limit``,
    ``after``, ``before``.

    Raises:
        InvalidRequestError: a bad ``order`` or ``limit``, or an ``after`` / ``before`` id that is
            not one of the items (400 naming the parameter).
    """
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequestError(f"'order' must be 'asc' or 'desc'; got {order!r}.", param="order")
    limit = _limit(query.get("limit"))
    data = [listed_item(item) for item in items]
    if order == "desc":
        data.reverse()
    ids = [item["id"] for item in data]
    if query.get("before") is not None:
        data = data[: _position(ids, query["before"], "before")]
    if query.get("after") is not None:
        data = data[_position(ids, query["after"], "after") + 1:]
    page = data[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit}
