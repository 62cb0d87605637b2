"""Compressed request bodies: ``Content-Encoding: gzip`` / ``deflate`` decoded as they stream in.

RFC 9110 (8.4) lets a client compress the request body; some SDKs and gateways do. The limit
``--max-body-bytes`` applies to the *decompressed* size, and the body is inflated at most
``limit + 1`` bytes at a time (``zlib``'s ``max_length`` with the unconsumed input kept), so a small
body that expands past the limit (a "zip bomb") is a 413 without ever holding more than the limit in
memory. ``identity`` (or no header) is the body as sent. Any other coding (``br``, ``zstd``,
``compress``, or a chain such as ``gzip, br``) is a 415 that names it.

``deflate`` is the zlib format (RFC 1950) per RFC 9110 8.4.1.2; the raw DEFLATE stream (RFC 1951) that
some clients send under that name is also accepted, told apart by the zlib header, as browsers and
curl do. ``x-gzip`` is ``gzip`` (RFC 9110 8.4.1.3).
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator

from proxy.errors import InvalidRequestError, PayloadTooLargeError, UnsupportedMediaTypeError

SUPPORTED = ("gzip", "x-gzip", "deflate", "identity")


def content_coding(header: str | None) -> str | None:
    """The one coding to undo, from a ``Content-Encoding`` header value, or None for the body as sent.

    Raises:
        UnsupportedMediaTypeError: a coding other than gzip, deflate or identity, or more than one (415).
    """
    if header is None:
        return None
    codings = [c.strip().lower() for c in header.split(",") if c.strip() and c.strip().lower() != "identity"]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in SUPPORTED:
        raise UnsupportedMediaTypeError(
            f"Content-Encoding {header.strip()!r} is not supported; send the body as is, or with gzip or "
            "deflate.",
            param="Content-Encoding",
        )
    return "gzip" if codings[0] == "x-gzip" else codings[0]


async def decoded_body(chunks: AsyncIterator[bytes], coding: str, limit: int) -> bytes:
    """Inflate a streamed body in ``coding`` (``gzip`` or ``deflate``), at most ``limit`` bytes out.

    Args:
        chunks: the body as received (e.g. Starlette's ``request.stream()``).
        coding: from :func:`content_coding`.
        limit: most decompressed bytes (``Settings.max_body_bytes``).

    Raises:
        PayloadTooLargeError: the decompressed body exceeds ``limit`` (413), detected while inflating.
        InvalidRequestError: the body is not valid data in ``coding``, or is cut short (400).
    """
    decomp: zlib._Decompress | None = zlib.decompressobj(16 + zlib.MAX_WBITS) if coding == "gzip" else None
    out: list[bytes] = []
    size = 0

    def feed(data: bytes) -> None:
        nonlocal size
        assert decomp is not None
        while data:
            try:
                piece = decomp.decompress(data, limit + 1 - size)
            except zlib.error as exc:
                raise InvalidRequestError(f"The request body is not valid {coding} data ({exc}).") from None
            size += len(piece)
            if size > limit:
                raise PayloadTooLargeError(
                    f"The request body exceeds the limit of {limit} bytes once decompressed ({coding})."
                )
            out.append(piece)
            data = decomp.unconsumed_tail
            if decomp.eof:
                if data or decomp.unused_data:
                    raise InvalidRequestError(
                        f"The request body has data after the end of its {coding} stream."
                    )
                return

    head = b""
    received = False
    async for chunk in chunks:
        if not chunk:
            continue
        received = True
        if decomp is None:  # deflate: zlib-wrapped or raw, told apart by the first two bytes
            head += chunk
            if len(head) < 2:
                continue
            zlib_wrapped = (head[0] & 0x0F) == 8 and (head[0] << 8 | head[1]) % 31 == 0
            decomp = zlib.decompressobj(zlib.MAX_WBITS if zlib_wrapped else -zlib.MAX_WBITS)
            chunk, head = head, b""
        if decomp.eof:
            raise InvalidRequestError(f"The request body has data after the end of its {coding} stream.")
        feed(chunk)
    if not received:
        return b""  # an empty body stays empty (the JSON parser then says what is wrong)
    if decomp is None:
        if head:
            raise InvalidRequestError(f"The request body is not valid {coding} data (too short).")
        return b""
    if not decomp.eof:
        raise InvalidRequestError(f"The request body is not valid {coding} data (the stream is cut short).")
    return b"".join(out)
