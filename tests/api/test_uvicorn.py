"""Real uvicorn on 127.0.0.1 over the scripted engine: incremental delivery, keep-alive, disconnects."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from proxy.api.app import create_app
from proxy.api.routes import ServingModel
from proxy.settings import Settings

from .conftest import MODEL, REPLY, chat_body, reply_ids, sse_events
from .fakes import FakeEngine, make_hf_tokenizer, make_tokenizer


@contextlib.contextmanager
def uvicorn_server(engine: FakeEngine, **settings) -> Iterator[tuple[int, object]]:
    tok = make_tokenizer()
    engine.eos_token_ids = frozenset({make_hf_tokenizer().convert_tokens_to_ids("<|im_end|>")})
    app = create_app(Settings(**settings), lambda _: ServingModel(engine, tok, MODEL, 4096))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(500):
            if server.started and app.state.server.status == "ready":
                break
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield port, app
    finally:
        server.should_exit = True
        thread.join(10)


def post(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def dechunk(body: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body."""
    out = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        out, body = out + body[:size], body[size + 2:]


def wait_until(pred, timeout=1.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.005)
    raise AssertionError("condition not met in time")


def test_stream_arrives_incrementally_with_exact_framing():
    engine = FakeEngine(step_s=0.05)
    with uvicorn_server(engine) as (port, _):
        engine.reply_ids = reply_ids(make_tokenizer())
        sock = post(port, chat_body(stream=True))
        arrivals, raw = [], b""
        while not raw.endswith(b"\r\n0\r\n\r\n"):  # the chunked-encoding terminator ends the response
            chunk = sock.recv(65536)
            assert chunk
            raw += chunk
            arrivals.append(time.monotonic())
        sock.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    events = sse_events(dechunk(body))
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == REPLY
    assert b"content-type: text/event-stream; charset=utf-8" in head.lower()
    assert b"x-accel-buffering: no" in head.lower() and b"cache-control: no-cache" in head.lower()
    assert b"transfer-encoding: chunked" in head.lower()
    assert len(arrivals) >= 5  # one write per engine step, not one lump at the end
    assert arrivals[-1] - arrivals[0] > 0.3


def test_keepalive_comment_while_idle():
    engine = FakeEngine(step_s=0.4)
    with uvicorn_server(engine, keepalive_interval_s=0.1) as (port, _):
        engine.reply_ids = reply_ids(make_tokenizer())
        sock = post(port, chat_body(stream=True, max_tokens=3))
        raw = b""
        while b"data: [DONE]" not in raw:
            raw += sock.recv(65536)
        sock.close()
    assert b"\r\n: keepalive\n\n" in raw or b": keepalive\n\n" in raw


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_engine_request(stream):
    engine = FakeEngine(step_s=0.02)
    with uvicorn_server(engine) as (port, app):
        engine.reply_ids = reply_ids(make_tokenizer())[:3]  # never reaches EOS: repeats forever
        sock = post(port, chat_body(stream=stream, max_tokens=3000))
        wait_until(lambda: engine.running, 2.0)
        if stream:
            buf = b""
            while b'"content":"H' not in buf:  # first content chunk arrived
                buf += sock.recv(65536)
        else:
            time.sleep(0.3)
        sock.close()
        elapsed = wait_until(lambda: not engine.running, 1.0)
        assert elapsed < 1.0
        assert len(engine.aborted) == 1
        wait_until(lambda: app.state.server.processor.num_tracked == 0, 1.0)
        metrics = app.state.server.metrics.render().decode()
        assert 'streamproxy:request_success_total{finished_reason="abort",model_name="test-model"} 1.0' in metrics
