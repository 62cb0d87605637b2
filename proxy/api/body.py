"""Reading a request body: the one place where bodies are read and decoded."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from proxy.errors import PayloadTooLargeError
from proxy.protocol import parse_json_body


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed ``limit`` bytes.

    Raises:
        PayloadTooLargeError: from ``Content-Length`` before reading, or while reading.
        starlette.requests.ClientDisconnect: the client left while sending.
    """
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLargeError(f"The request body is {length} bytes; the limit is {limit} bytes.")
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
    return parse_json_body(await read_body(request, limit))
