"""Graceful shutdown: drain (503 for new requests), a grace period for running streams, then an
SSE error event + [DONE] for the rest; SIGTERM on a real process exits 0 with no hung sockets."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from api.conftest import chat_body, serve, sse_json
from api.fakes import FakeEngine, make_hf_tokenizer, make_tokenizer

from .helpers import TINY, TINY_ARGS, chunks_and_done, make_tiny_model, start_server, stream_text

SHUTDOWN_ERROR = {"message": "The server is shutting down; the response was cut short. Retry the request.",
                  "type": "server_error", "param": None, "code": "server_shutdown"}


def long_script(prompt: list[int], params) -> list[int]:
    ids = list(make_tokenizer().encode("alpha beta "))
    eos = make_hf_tokenizer().convert_tokens_to_ids("<|im_end|>")
    return ids * 2000 if params.ignore_eos else ids + [eos]


class _IgnoreEos:
    ignore_eos = True


def test_drain_lets_short_streams_finish_and_cuts_the_rest():
    async def main():
        engine = FakeEngine(script=long_script, step_s=0.01)
        async with serve(engine, max_model_len=4096) as s:
            state = s.app.state.server
            long_req = asyncio.create_task(s.client.post(
                "/v1/chat/completions", json=chat_body(stream=True, max_tokens=3000, ignore_eos=True)))
            long_plain = asyncio.create_task(s.client.post(
                "/v1/chat/completions", json=chat_body(max_tokens=3000, ignore_eos=True)))
            short_req = asyncio.create_task(s.client.post(
                "/v1/chat/completions", json=chat_body(stream=True, max_tokens=30, ignore_eos=True)))
            while len(engine.submitted) < 3:
                await asyncio.sleep(0.005)
            state.begin_drain(1.0)
            refused = await s.client.post("/v1/chat/completions", json=chat_body(stream=True))
            health = await s.client.get("/health")
            short, long_, plain = await asyncio.gather(short_req, long_req, long_plain)
            return refused, health, short, long_, plain, engine, state

    refused, health, short, long_, plain, engine, state = asyncio.run(main())
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutdown"
    assert health.status_code == 503 and health.json()["status"] == "draining"
    short_chunks = sse_json(short.content)
    assert short_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert stream_text(short_chunks) == make_tokenizer().decode(long_script([], _IgnoreEos())[:30])
    long_chunks = sse_json(long_.content)
    assert long_chunks[-1] == {"error": SHUTDOWN_ERROR}
    assert len(stream_text(long_chunks[:-1])) > 0  # it streamed for the grace period, then was cut
    assert plain.status_code == 503 and plain.json() == {"error": SHUTDOWN_ERROR}
    assert len(engine.aborted) == 2 and not engine.running  # engine work of the cut requests stopped
    assert engine.draining  # the engine core was told (an engine process is not restarted from then on)
    assert state.client.stats().num_tracked_outputs == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-shutdown") / "tiny")


def _stream_in_thread(url: str, body: dict, out: dict, first: threading.Event) -> threading.Thread:
    def run() -> None:
        raw = b""
        try:
            with httpx.stream("POST", url, json=body, timeout=60) as r:
                out["status"] = r.status_code
                for piece in r.iter_raw():
                    raw += piece
                    if b'"text"' in raw:
                        first.set()
        except Exception as exc:  # noqa: BLE001 - reported through out
            out["exc"] = repr(exc)
        out["raw"] = raw
        out["t_end"] = time.monotonic()
        first.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("mode", [[], ["--engine-process"]], ids=["engine-thread", "engine-process"])
def test_sigterm_real_process(model_dir: Path, tmp_path: Path, mode: list[str]):
    grace = 4.0  # the drain window the 503 checks below fall in, with room on a slow machine
    proc = start_server(
        tmp_path, ["--model", str(model_dir), *TINY_ARGS, "--shutdown-grace-s", str(grace), *mode]
    )
    url = f"{proc.base_url}/v1/completions"
    base = {"model": TINY, "prompt": "Hello", "temperature": 0, "ignore_eos": True}
    reference = httpx.post(url, json={**base, "max_tokens": 40}, timeout=60).json()["choices"][0]["text"]
    assert len(reference) > 10
    long_out: dict = {}
    short_out: dict = {}
    long_first, short_first = threading.Event(), threading.Event()
    long_t = _stream_in_thread(url, {**base, "max_tokens": 16000, "stream": True}, long_out, long_first)
    assert long_first.wait(30)
    short_t = _stream_in_thread(url, {**base, "max_tokens": 40, "stream": True}, short_out, short_first)
    assert short_first.wait(30)
    t_term = time.monotonic()
    proc.process.send_signal(signal.SIGTERM)
    # while the long stream drains the replica still listens, and says so (a router's health check,
    # a client's next request on a new connection): 503 draining / server_shutdown, not refused
    time.sleep(0.3)
    health = httpx.get(f"{proc.base_url}/health", timeout=10)
    refused = httpx.post(url, json={**base, "max_tokens": 4}, timeout=10)
    long_t.join(60)
    short_t.join(60)
    code = proc.process.wait(60)
    t_exit = time.monotonic()
    log = proc.log()
    assert code == 0, log[-3000:]
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "server_shutdown"
    # the short stream finished normally, with the text of the same request before
    short_chunks = chunks_and_done(short_out["raw"])
    assert short_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert stream_text(short_chunks, chat=False) == reference
    # the long one was cut after the grace period: error event, then [DONE]
    long_chunks = chunks_and_done(long_out["raw"])
    assert long_chunks[-1] == {"error": SHUTDOWN_ERROR}
    assert long_out["t_end"] - t_term >= grace - 0.2
    assert t_exit - t_term < grace + 10
    # nothing listens any more; no request hung
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", proc.port), timeout=1).close()
    assert "exc" not in long_out and "exc" not in short_out
    assert "Traceback" not in log and "Cancel" not in log, log[-3000:]
    assert json.loads(json.dumps(long_chunks[0]))["object"] == "text_completion"
