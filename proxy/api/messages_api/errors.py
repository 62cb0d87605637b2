"""Errors of the Messages endpoints in Anthropic's envelope and statuses (Anthropic "Errors").

``{"type": "error", "error": {"type": <error type>, "message": <text>}}``; the error types by status:
400 / 405 / 413 / 415 ``invalid_request_error`` (413: ``request_too_large``), 401
``authentication_error``, 404 ``not_found_error``, 500 ``api_error``, 503 (loading, draining, engine
down) ``overloaded_error``. A full waiting queue (our 429) is Anthropic's 529 ``overloaded_error``
(the server is overloaded, not the client over a rate), with ``Retry-After``; the Anthropic SDKs
retry 529 as they retry 429. ``app.py`` answers every error of a ``/v1/messages`` path through
:func:`anthropic_error_response`.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from proxy.errors import RateLimitError, StreamproxyError

from ..responses import json_response, retry_headers

PATH_PREFIX = "/v1/messages"
OVERLOADED_STATUS = 529
"""Anthropic's status for an overloaded API (``overloaded_error``)."""
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
          415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
          OVERLOADED_STATUS: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is one of the Messages endpoints (whose errors take Anthropic's envelope)."""
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def anthropic_status(exc: StreamproxyError) -> int:
    """The HTTP status of ``exc`` on a Messages endpoint (a full queue: 529, else the error's own)."""
    return OVERLOADED_STATUS if isinstance(exc, RateLimitError) else exc.status


def anthropic_error(exc: StreamproxyError) -> dict[str, Any]:
    """Anthropic's error envelope of ``exc``, typed by its status (``api_error`` for any other)."""
    kind = _TYPES.get(anthropic_status(exc), "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def anthropic_error_response(exc: StreamproxyError, headers: dict[str, str] | None = None) -> Response:
    """The JSON error response of ``exc`` on a Messages endpoint (529, and a 503 while a model loads,
    add ``Retry-After``: ``proxy.api.responses.retry_headers``)."""
    return json_response(anthropic_error(exc), anthropic_status(exc), retry_headers(exc, headers))
