"""Issue 12, request leniency through the whole app: a UTF-8 byte-order mark before the JSON (item 6),
gzip/deflate request bodies with the limit on the decompressed size and 415 for other codings
(item 7), and the headers of an admitted stream within a second (item 4)."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import zlib
from dataclasses import dataclass, field

import pytest

from proxy.settings import Settings

from .conftest import MODEL, REPLY, chat_body, reply_ids, run, serve, sse_json
from .fakes import FakeEngine, dechunk, make_tokenizer, post_stream, thread_server


def _post_all(bodies: list[tuple[bytes, dict[str, str]]], **settings) -> list:
    async def main():
        async with serve(**settings) as s:
            return [await s.client.post("/v1/chat/completions", content=raw, headers=headers)
                    for raw, headers in bodies]

    return run(main())


def test_utf8_bom_before_the_json_is_skipped():
    raw = json.dumps(chat_body("Hi")).encode()
    plain, bom, bom_stream = _post_all(
        [
            (raw, {"Content-Type": "application/json"}),
            (b"\xef\xbb\xbf" + raw, {"Content-Type": "application/json"}),
            (
                b"\xef\xbb\xbf" + json.dumps(chat_body("Hi", stream=True)).encode(),
                {"Content-Type": "application/json"},
            ),
        ]
    )
    assert plain.status_code == bom.status_code == bom_stream.status_code == 200, bom.text
    assert (
        bom.json()["choices"][0]["message"]["content"]
        == plain.json()["choices"][0]["message"]["content"]
        == REPLY
    )
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in sse_json(bom_stream.content)
                   if c["choices"]) == REPLY


def test_a_bom_alone_or_twice_is_still_a_400():
    only, twice = _post_all([(b"\xef\xbb\xbf", {}), (b"\xef\xbb\xbf\xef\xbb\xbf{}", {})])
    assert only.status_code == twice.status_code == 400
    assert "empty" in only.json()["error"]["message"]


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


def test_gzip_and_deflate_bodies_are_decoded():
    raw = json.dumps(chat_body("Hi")).encode()
    responses = _post_all([
        (gzip.compress(raw), {"Content-Encoding": "gzip", "Content-Type": "application/json"}),
        (zlib.compress(raw), {"Content-Encoding": "deflate"}),
        (_raw_deflate(raw), {"Content-Encoding": "deflate"}),
        (gzip.compress(b"\xef\xbb\xbf" + raw), {"Content-Encoding": "x-gzip"}),
        (raw, {"Content-Encoding": "identity"}),
    ])
    for r in responses:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == REPLY


def test_decompressed_size_is_limited_413():
    """A 5 KB body that gzips to ~100 bytes is over a 1000-byte limit once decompressed; a 64 MiB bomb
    is refused while inflating (the limit applies to what the body expands to)."""
    small = json.dumps(chat_body("x" * 5000)).encode()
    bomb = gzip.compress(b" " * (64 << 20), compresslevel=9)
    fits = json.dumps(chat_body("Hi")).encode()
    a, c = _post_all([(gzip.compress(small), {"Content-Encoding": "gzip"}),
                      (gzip.compress(fits), {"Content-Encoding": "gzip"})], max_body_bytes=1000)
    assert len(gzip.compress(small)) < 1000
    assert len(bomb) < 1 << 20
    (b,) = _post_all([(bomb, {"Content-Encoding": "gzip"})], max_body_bytes=1 << 20)
    for r in (a, b):
        assert r.status_code == 413, r.text
        assert (
            r.json()["error"]["code"] == "payload_too_large"
            and "decompressed" in r.json()["error"]["message"]
        )
    assert c.status_code == 200


@pytest.mark.parametrize("coding", ["br", "zstd", "gzip, br"])
def test_other_content_encodings_are_415_naming_them(coding):
    (r,) = _post_all([(b"\x00\x01garbage", {"Content-Encoding": coding})])
    assert r.status_code == 415
    err = r.json()["error"]
    assert coding in err["message"] and err["type"] == "invalid_request_error"
    assert err["code"] == "unsupported_content_encoding" and err["param"] == "Content-Encoding"


def test_corrupt_gzip_is_a_400_not_a_utf8_complaint():
    (r,) = _post_all([(b"\x1f\x8b\x08\x00garbage", {"Content-Encoding": "gzip"})])
    assert r.status_code == 400
    assert "gzip" in r.json()["error"]["message"] and "UTF-8" not in r.json()["error"]["message"]


@dataclass
class _NeverStartsEngine(FakeEngine):
    """The scripted engine, but no request produces output until ``release`` is set (a request queued
    behind long prompts)."""

    release: threading.Event = field(default_factory=threading.Event)

    async def _run(self, r) -> None:  # type: ignore[no-untyped-def]
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        await super()._run(r)


def test_admitted_stream_gets_headers_and_role_chunk_within_the_header_timeout():
    """Item 4: with the default 15 s keep-alive interval, a stream whose request waits for the engine
    still gets 200, its headers, a comment and the role chunk after stream_headers_timeout_s (default
    1 s), long before any token or keep-alive comment; the text follows once the engine runs."""
    assert Settings().stream_headers_timeout_s == 1.0 and Settings().keepalive_interval_s == 15.0
    engine = _NeverStartsEngine(reply_ids=reply_ids(make_tokenizer()))
    with thread_server(engine) as (port, _):
        sock = post_stream(
            port, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
        )
        sock.settimeout(10)  # without the header timeout nothing arrives for 15 s
        raw = b""
        while b'"role":"assistant"' not in raw:
            chunk = sock.recv(65536)
            assert chunk, raw
            raw += chunk
        (running,) = engine.running.values()
        assert running.num_out == 0  # nothing generated yet
        assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"content-type: text/event-stream; charset=utf-8" in raw.lower()
        engine.release.set()
        while not raw.endswith(b"\r\n0\r\n\r\n"):
            chunk = sock.recv(65536)
            assert chunk, raw[-200:]
            raw += chunk
        sock.close()
    body = dechunk(raw.partition(b"\r\n\r\n")[2])
    assert body.startswith(b": keepalive\n\n")
    chunks = sse_json(body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:] if c["choices"]) == REPLY


def test_early_failure_within_the_header_timeout_is_still_a_status():
    """Before the headers go out an engine failure is a plain JSON 500 (not an SSE stream)."""
    engine = FakeEngine(reply_ids=reply_ids(make_tokenizer()), fail_after=0)

    async def main():
        async with serve(engine) as s:
            return await s.client.post("/v1/chat/completions", json=chat_body("Hi", stream=True))

    r = run(main())
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
