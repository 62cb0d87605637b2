"""SSE keep-alive comments while a request waits for its first output (queue wait, long prefill)."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import openai
from api.fakes import FakeEngine, dechunk, make_hf_tokenizer, make_tokenizer, post_stream

from .helpers import chunks_and_done, events, stream_text, thread_server

REPLY = "Hello world! alpha beta 你好 🤗 END"


def reply_ids() -> list[int]:
    return list(make_tokenizer().encode(REPLY)) + [make_hf_tokenizer().convert_tokens_to_ids("<|im_end|>")]


@dataclass
class SlowStartEngine(FakeEngine):
    """The scripted engine, but the first token of each request comes after ``first_delay_s``
    (as when the request waits in the queue or in a long prefill)."""

    first_delay_s: float = 0.5

    async def _run(self, r) -> None:  # type: ignore[no-untyped-def]
        await asyncio.sleep(self.first_delay_s)
        await super()._run(r)


def read_all(sock: socket.socket) -> bytes:
    raw = b""
    while not raw.endswith(b"\r\n0\r\n\r\n"):
        chunk = sock.recv(65536)
        assert chunk, raw[-200:]
        raw += chunk
    sock.close()
    return raw


BODY = {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], "stream": True}


def test_headers_and_comment_go_out_before_the_first_output():
    engine = SlowStartEngine(reply_ids=reply_ids(), first_delay_s=1.0)
    with thread_server(engine, keepalive_interval_s=0.1) as (port, _):
        sock = post_stream(port, BODY)
        raw = b""
        while b": keepalive\n\n" not in raw:
            chunk = sock.recv(65536)
            assert chunk
            raw += chunk
        # the engine has not produced a token yet, and the client already has 200 + a comment
        (running,) = engine.running.values()
        assert running.num_out == 0
        assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"content-type: text/event-stream; charset=utf-8" in raw.lower()
        raw += read_all(sock)
    body = dechunk(raw.partition(b"\r\n\r\n")[2])
    evs = events(body)
    assert evs[0] == b": keepalive"
    num_comments = sum(e == b": keepalive" for e in evs)
    assert 5 <= num_comments <= 12  # about one per 0.1 s during the 1 s wait
    assert stream_text(chunks_and_done(body)) == REPLY


def test_failure_after_the_headers_is_an_error_event_then_done():
    engine = SlowStartEngine(reply_ids=reply_ids(), first_delay_s=0.4, fail_after=0)
    with thread_server(engine, keepalive_interval_s=0.1) as (port, _):
        raw = read_all(post_stream(port, BODY))
    assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
    body = dechunk(raw.partition(b"\r\n\r\n")[2])
    assert body.startswith(b": keepalive\n\n")
    chunks = chunks_and_done(body)
    assert chunks[-1] == {"error": {"message": "injected failure", "type": "server_error", "param": None,
                                    "code": "engine_error"}}
    assert stream_text(chunks[:-1]) == ""
    assert all(c["choices"][0].get("finish_reason") is None for c in chunks[:-1])  # none fabricated


def test_openai_sdk_ignores_comments():
    engine = SlowStartEngine(reply_ids=reply_ids(), first_delay_s=0.4, step_s=0.08)
    with thread_server(engine, keepalive_interval_s=0.05) as (port, _):
        raw = read_all(post_stream(port, BODY))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "Hi"}], stream=True
        )
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        completion = client.completions.create(model="test-model", prompt="Hi", stream=True)
        text = "".join(c.choices[0].text for c in completion)
    # the stream the SDK read had comments before and between the content chunks
    evs = events(dechunk(raw.partition(b"\r\n\r\n")[2]))
    assert evs[0] == b": keepalive" and evs.count(b": keepalive") >= 8
    assert "".join(pieces) == REPLY and text == REPLY
