"""The built-in chat page: static files shipped inside the package, served at ``/`` and ``/ui/<file>``.

``index.html``, ``chat.css`` and ``chat.js`` sit beside this module (package data, so an installed
wheel has them; no build step, nothing fetched from elsewhere). The page is a client of the public
API only (``GET /v1/models``, ``POST /v1/chat/completions`` with ``stream: true``); see the header
of ``chat.js``. ``--no-ui`` (``Settings.ui = False``) turns the routes off, and ``/`` is a 404 again.

This module is framework-free: ``proxy.api.app`` (the only Starlette importer) turns a
:class:`StaticAsset` into a response.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
"""The page's CSP: its own script and stylesheet only (no inline code, no eval), requests to this
origin only, no framing. ``img-src data:`` is for the empty favicon (``<link rel="icon" href="data:,">``)."""

SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
"""Headers of every UI response (``no-cache``: the browser revalidates, so an upgraded server's page is
seen)."""

MEDIA_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
}
"""The files of the page and their media types; nothing else under ``/ui/`` is served."""

INDEX = "index.html"


@dataclass(frozen=True)
class StaticAsset:
    """One file of the page: ``body`` (bytes), its ``media_type`` and the :data:`SECURITY_HEADERS`."""

    body: bytes
    media_type: str
    headers: dict[str, str]


@functools.cache
def asset(name: str) -> StaticAsset | None:
    """The file ``name`` of the page (``"index.html"``, ``"chat.css"``, ``"chat.js"``), or None for
    any other name (the route answers 404). Read once from the package and cached."""
    media_type = MEDIA_TYPES.get(name)
    if media_type is None:
        return None
    body = resources.files(__name__).joinpath(name).read_bytes()
    return StaticAsset(body, media_type, dict(SECURITY_HEADERS))
