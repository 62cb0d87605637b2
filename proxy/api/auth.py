"""Bearer API keys on ``/v1/*`` (``--api-key``); ``/health`` and ``/metrics`` stay open."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.errors import AuthenticationError

from .responses import error_response


def is_authorized(header: str, api_keys: tuple[str, ...]) -> bool:
    """Whether an ``Authorization`` header value carries one of ``api_keys`` as a bearer token.

    Compared with every key in constant time per key (no early exit on a match); keys are never logged.
    """
    scheme, _, key = header.partition(" ")
    given = key.strip().encode("utf-8", "surrogateescape")
    ok = False
    for accepted in api_keys:
        ok |= hmac.compare_digest(given, accepted.encode("utf-8", "surrogateescape"))
    return scheme.lower() == "bearer" and ok


class ApiKeyMiddleware:
    """Pure ASGI middleware: 401 with an OpenAI error object (``invalid_api_key``) for a ``/v1``
    request without a valid key. Sits inside the CORS middleware, so preflights pass."""

    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...]) -> None:
        self.app = app
        self.api_keys = api_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    header = value
                    break
            if not is_authorized(header.decode("latin-1"), self.api_keys):
                err = AuthenticationError("Missing or invalid API key (send 'Authorization: Bearer <key>').")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)
