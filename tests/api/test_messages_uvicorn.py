"""The Messages stream over a real uvicorn on 127.0.0.1 and the scripted engine: ``ping`` events while
the engine is slow, incremental delivery, and a client that leaves mid-stream (or before a non-stream
answer) aborts its engine request at once."""

from __future__ import annotations

import time

import pytest

from .conftest import reply_ids
from .fakes import FakeEngine, dechunk, make_tokenizer, post_stream, thread_server
from .messages_sse import body, events, fold


def _wait_until(pred, timeout: float = 2.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return
        time.sleep(0.005)
    raise AssertionError("condition not met in time")


def test_ping_while_idle_and_incremental_delivery() -> None:
    engine = FakeEngine(step_s=0.15)
    with thread_server(engine, keepalive_interval_s=0.05) as (port, _):
        engine.reply_ids = reply_ids(make_tokenizer())[:4] + reply_ids(make_tokenizer())[-1:]
        sock = post_stream(port, body(stream=True), path="/v1/messages")
        raw, arrivals = b"", []
        while not raw.endswith(b"\r\n0\r\n\r\n"):
            chunk = sock.recv(65536)
            assert chunk
            raw += chunk
            arrivals.append(time.monotonic())
        sock.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and b"text/event-stream" in head
    evts = events(dechunk(payload))
    assert sum(e["type"] == "ping" for e in evts) >= 3  # one after message_start, then while waiting
    assert fold(evts)["stop_reason"] == "end_turn"
    assert len(arrivals) >= 4 and arrivals[-1] - arrivals[0] > 0.3


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_aborts_its_engine_request(stream: bool) -> None:
    engine = FakeEngine(step_s=0.02)
    with thread_server(engine) as (port, app):
        engine.reply_ids = reply_ids(make_tokenizer())[:3]  # no EOS: would run to max_tokens
        sock = post_stream(port, body(stream=stream, max_tokens=3000), path="/v1/messages")
        _wait_until(lambda: bool(engine.running))
        if stream:
            buf = b""
            while b"text_delta" not in buf:
                buf += sock.recv(65536)
        sock.close()
        _wait_until(lambda: not engine.running)
        assert len(engine.aborted) == 1
        client = app.state.server.client
        _wait_until(lambda: client.stats().num_tracked_outputs == 0)
