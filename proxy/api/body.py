"""Reading a request body: the one place where bodies are read and decoded."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from proxy.errors import PayloadTooLargeError
from proxy.protocol import parse_json_body

from .content_encoding import content_coding, decoded_body

BODY_KEY = "streamproxy.body"
"""The request scope's key of a body already read and parsed (``proxy.api.on_demand`` reads it first)."""


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, decompressed when sent with ``Content-Encoding: gzip`` or ``deflate``, or 413 as
    soon as it is known to exceed ``limit`` bytes (for a compressed body: once decompressed, see
    :mod:`proxy.api.content_encoding`).

    Raises:
        UnsupportedMediaTypeError: any other ``Content-Encoding`` (415), before reading.
        PayloadTooLargeError: from ``Content-Length`` before reading, or while reading / inflating.
        InvalidRequestError: a compressed body that is not valid in its coding (400).
        starlette.requests.ClientDisconnect: the client left while sending.
    """
    coding = content_coding(request.headers.get("content-encoding"))
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLargeError(f"The request body is {length} bytes; the limit is {limit} bytes.")
    if coding is not None:
        return await decoded_body(request.stream(), coding, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"The request body exceeds the limit of {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json_body(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object (any ``Content-Type``; ``text/plain`` with JSON works).

    Raises:
        PayloadTooLargeError: over ``limit`` bytes (413).
        InvalidRequestError: not UTF-8, not JSON, or not an object (400).
    """
    cached: dict[str, Any] | None = request.scope.get(BODY_KEY)
    if cached is not None:
        return cached
    return parse_json_body(await read_body(request, limit))
