"""API keys on ``/v1/*`` (``--api-key``): ``Authorization: Bearer <key>`` (OpenAI's) or ``x-api-key:
<key>`` (Anthropic's), either on every endpoint; ``/health``, ``/metrics`` and ``/`` stay open."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.errors import AuthenticationError

from .messages_api.errors import anthropic_error_response, is_messages_path
from .responses import error_response

PROTECTED_PREFIXES = ("/v1", "/models/")
"""Paths that need a key: the API, and the model load / unload endpoints of a several-model server."""


def _is_key(given: str, api_keys: tuple[str, ...]) -> bool:
    """``given`` is one of ``api_keys``, compared with every key in constant time per key (no early
    exit on a match); keys are never logged."""
    raw = given.strip().encode("utf-8", "surrogateescape")
    ok = False
    for accepted in api_keys:
        ok |= hmac.compare_digest(raw, accepted.encode("utf-8", "surrogateescape"))
    return ok


def is_authorized(header: str, api_keys: tuple[str, ...], x_api_key: str | None = None) -> bool:
    """Whether an ``Authorization`` header value carries one of ``api_keys`` as a bearer token, or
    the ``x-api-key`` header value (Anthropic's SDKs send it; None: absent) is one of them."""
    scheme, _, key = header.partition(" ")
    bearer = _is_key(key, api_keys) and scheme.lower() == "bearer"
    return bearer or (x_api_key is not None and _is_key(x_api_key, api_keys))


class ApiKeyMiddleware:
    """Pure ASGI middleware: 401 for a ``/v1`` request without a valid key, with an OpenAI error
    object (``invalid_api_key``), or Anthropic's envelope (``authentication_error``) on the Messages
    paths. Sits inside the CORS middleware, so preflights pass."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.api_keys = api_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            header, x_api_key = b"", None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    header = value
                elif name == b"x-api-key":
                    x_api_key = value.decode("latin-1")
            if not is_authorized(header.decode("latin-1"), self.api_keys, x_api_key):
                err = AuthenticationError("Missing or invalid API key (send 'Authorization: Bearer <key>' "
                                          "or 'x-api-key: <key>').")
                path = scope["path"]
                reply = anthropic_error_response(err) if is_messages_path(path) else error_response(err)
                await reply(scope, receive, send)
                return
        await self.app(scope, receive, send)
