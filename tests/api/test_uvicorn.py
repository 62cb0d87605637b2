"""Real uvicorn on 127.0.0.1 over the scripted engine: incremental delivery, keep-alive, disconnects."""

from __future__ import annotations

import json
import time

import pytest

from .conftest import REPLY, chat_body, reply_ids, sse_events
from .fakes import FakeEngine, dechunk, make_tokenizer, post_stream, thread_server


def wait_until(pred, timeout=1.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(0.005)
    raise AssertionError("condition not met in time")


def test_stream_arrives_incrementally_with_exact_framing():
    engine = FakeEngine(step_s=0.05)
    with thread_server(engine) as (port, _):
        engine.reply_ids = reply_ids(make_tokenizer())
        sock = post_stream(port, chat_body(stream=True))
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
    with thread_server(engine, keepalive_interval_s=0.1) as (port, _):
        engine.reply_ids = reply_ids(make_tokenizer())
        sock = post_stream(port, chat_body(stream=True, max_tokens=3))
        raw = b""
        while b"data: [DONE]" not in raw:
            raw += sock.recv(65536)
        sock.close()
    assert b"\r\n: keepalive\n\n" in raw or b": keepalive\n\n" in raw


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_engine_request(stream, caplog):
    engine = FakeEngine(step_s=0.02)
    with thread_server(engine) as (port, app):
        engine.reply_ids = reply_ids(make_tokenizer())[:3]  # never reaches EOS: repeats forever
        sock = post_stream(port, chat_body(stream=stream, max_tokens=3000))
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
        client = app.state.server.client
        wait_until(lambda: client.stats().num_tracked_outputs == 0, 1.0)
        metrics = client.metrics.render().decode()
        assert (
            'streamproxy:request_success_total{finished_reason="abort",model_name="test-model"} 1.0'
            in metrics
        )
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]  # a disconnect is no error
