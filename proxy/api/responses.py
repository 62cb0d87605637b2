"""JSON and error responses, and the SSE response headers."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

from proxy.errors import RateLimitError, ServiceUnavailableError, StreamproxyError

RETRY_AFTER_S = 1
"""``Retry-After`` (seconds) of a 429: the waiting queue turns over within about a second of decode."""

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """Compact UTF-8 JSON; a stray surrogate in a message becomes the JSON escape, never a 500."""
    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def retry_headers(exc: StreamproxyError, headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """``headers`` with the ``Retry-After`` of ``exc``: :data:`RETRY_AFTER_S` for a 429, a 503's own
    ``retry_after_s`` when it has one (a model loading)."""
    if isinstance(exc, RateLimitError):
        return {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
    if isinstance(exc, ServiceUnavailableError) and exc.retry_after_s is not None:
        return {**(headers or {}), "Retry-After": str(exc.retry_after_s)}
    return headers


def error_response(exc: StreamproxyError, headers: dict[str, str] | None = None) -> Response:
    """The OpenAI error object with the exception's status and ``Retry-After`` (:func:`retry_headers`)."""
    return json_response(exc.to_dict(), exc.status, retry_headers(exc, headers))
