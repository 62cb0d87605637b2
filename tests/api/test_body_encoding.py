"""Issue 12 items 6 and 7 at the body layer: Content-Encoding gzip/deflate decoded with the limit on the
decompressed size (a zip bomb is a 413 without filling memory), other codings a 415 naming them."""

from __future__ import annotations

import asyncio
import gzip
import tracemalloc
import zlib
from collections.abc import AsyncIterator

import pytest

from proxy.api.content_encoding import content_coding, decoded_body
from proxy.errors import InvalidRequestError, PayloadTooLargeError, UnsupportedMediaTypeError

BODY = b'{"model": "m", "messages": [{"role": "user", "content": "h\xc3\xa9llo"}]}'


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


def decode(data: bytes, coding: str, limit: int = 1 << 20, size: int = 7) -> bytes:
    return asyncio.run(decoded_body(_chunks(data, size), coding, limit))


def raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


@pytest.mark.parametrize("header,coding", [
    (None, None), ("identity", None), ("gzip", "gzip"), ("GZip ", "gzip"), ("x-gzip", "gzip"),
    ("deflate", "deflate"), ("identity, gzip", "gzip"),
])
def test_content_coding_accepted(header, coding):
    assert content_coding(header) == coding


@pytest.mark.parametrize("header", ["br", "zstd", "compress", "gzip, br", "gzip, gzip"])
def test_other_codings_are_415_naming_them(header):
    with pytest.raises(UnsupportedMediaTypeError) as info:
        content_coding(header)
    assert info.value.status == 415 and header in info.value.message
    assert info.value.to_dict()["error"]["param"] == "Content-Encoding"


@pytest.mark.parametrize("size", [1, 2, 7, 4096])
def test_gzip_and_both_deflate_forms_decode(size):
    assert decode(gzip.compress(BODY), "gzip", size=size) == BODY
    assert decode(zlib.compress(BODY), "deflate", size=size) == BODY  # RFC 1950 (the HTTP spec's deflate)
    assert decode(raw_deflate(BODY), "deflate", size=size) == BODY  # raw RFC 1951, as some clients send


def test_limit_is_on_the_decompressed_size():
    assert decode(gzip.compress(BODY), "gzip", limit=len(BODY)) == BODY
    with pytest.raises(PayloadTooLargeError) as info:
        decode(gzip.compress(BODY), "gzip", limit=len(BODY) - 1)
    assert info.value.status == 413 and "decompressed" in info.value.message


def test_zip_bomb_is_413_without_filling_memory():
    """64 MiB of zeros compress to ~64 KiB; with a 1 MiB limit inflating stops at the limit."""
    bomb = gzip.compress(b"\0" * (64 << 20), compresslevel=9)
    assert len(bomb) < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLargeError):
            decode(bomb, "gzip", limit=1 << 20, size=65536)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


@pytest.mark.parametrize("data,coding", [
    (b"not gzip at all", "gzip"), (gzip.compress(BODY)[:-6], "gzip"), (gzip.compress(BODY) + b"x", "gzip"),
    (b"\xff", "deflate"), (zlib.compress(BODY)[:-3], "deflate"),
])
def test_corrupt_or_truncated_is_400(data, coding):
    with pytest.raises(InvalidRequestError) as info:
        decode(data, coding)
    assert info.value.status == 400 and coding in info.value.message


def test_empty_compressed_body():
    assert decode(gzip.compress(b""), "gzip") == b""
    assert decode(b"", "gzip") == b""
