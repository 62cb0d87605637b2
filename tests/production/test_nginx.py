"""streamproxy behind a real nginx with the shipped docs/nginx.conf (ports rewritten to free ones).

The replicas are the real app in uvicorn over the scripted engine (deterministic text with
multibyte characters, fast); skipped with a reason when nginx is not installed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
from api.fakes import FakeEngine, make_hf_tokenizer, make_tokenizer

from .helpers import chunks_and_done, nginx, nginx_binary, stream_text, thread_server

REPLY = "Hello world! alpha beta 你好 🤗 café END"


def reply_ids() -> list[int]:
    return list(make_tokenizer().encode(REPLY)) + [make_hf_tokenizer().convert_tokens_to_ids("<|im_end|>")]


def body(**kw) -> dict:
    return {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], **kw}


def test_stream_passes_unbuffered_and_text_is_intact(tmp_path: Path):
    nginx_binary()
    engine = FakeEngine(reply_ids=reply_ids(), step_s=0.06)
    with thread_server(engine) as (port, _), nginx(tmp_path, [port, port]) as lb:
        arrivals: list[tuple[float, bytes]] = []
        with httpx.stream("POST", f"http://127.0.0.1:{lb}/v1/chat/completions", json=body(stream=True),
                          timeout=30) as r:
            assert r.status_code == 200
            assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
            for piece in r.iter_raw():
                arrivals.append((time.monotonic(), piece))
        raw = b"".join(p for _, p in arrivals)
        plain = httpx.post(f"http://127.0.0.1:{lb}/v1/chat/completions", json=body(), timeout=30).json()
    chunks = chunks_and_done(raw)
    assert stream_text(chunks) == REPLY  # multibyte characters intact through nginx
    assert plain["choices"][0]["message"]["content"] == REPLY
    # the first content chunk reaches the client while the engine is still generating
    seen = b""
    first_content_t = None
    for t, piece in arrivals:
        seen += piece
        if b'"content":"H' in seen:
            first_content_t = t
            break
    assert first_content_t is not None
    num_tokens = len(reply_ids())
    assert num_tokens >= 10
    last_t = arrivals[-1][0]
    # unbuffered: about (num_tokens - 2) engine steps of 60 ms separate the first content from the end
    assert last_t - first_content_t > 0.5 * (num_tokens - 2) * 0.06
    assert len(arrivals) >= num_tokens // 2  # many separate reads, not one lump at the end


def test_two_replicas_behind_one_nginx_least_conn(tmp_path: Path):
    nginx_binary()
    def script(prompt: list[int], params) -> list[int]:  # long requests: text without EOS
        return reply_ids() if not params.ignore_eos else reply_ids()[:-1] * 300

    a = FakeEngine(script=script, step_s=0.02)
    b = FakeEngine(script=script, step_s=0.02)
    with thread_server(a) as (port_a, _), thread_server(b) as (port_b, _), \
            nginx(tmp_path, [port_a, port_b]) as lb:
        url = f"http://127.0.0.1:{lb}/v1/chat/completions"
        # hold one long stream open on one replica
        first_chunk = threading.Event()
        stop = threading.Event()

        def hold() -> None:
            with httpx.stream("POST", url, json=body(stream=True, max_tokens=3000, ignore_eos=True),
                              timeout=60) as r:
                for piece in r.iter_raw():
                    if b'"content"' in piece:
                        first_chunk.set()
                    if stop.is_set():
                        return

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        assert first_chunk.wait(10)
        busy, idle = (a, b) if a.running else (b, a)
        assert len(busy.running) == 1 and not idle.running
        # least_conn: while the stream is open, new requests go to the other replica
        for _ in range(3):
            r = httpx.post(url, json=body(max_tokens=3), timeout=30)
            assert r.status_code == 200
        assert len(idle.submitted) == 3 and len(busy.submitted) == 1
        stop.set()
        holder.join(10)
        assert not holder.is_alive()
        for _ in range(200):  # the disconnect reaches the replica and aborts the request there
            if not busy.running:
                break
            time.sleep(0.02)
        assert not busy.running and len(busy.aborted) == 1
        # both replicas serve with the exact reply
        texts = [httpx.post(url, json=body(), timeout=30).json()["choices"][0]["message"]["content"]
                 for _ in range(4)]
    assert texts == [REPLY] * 4
    assert len(a.submitted) >= 2 and len(b.submitted) >= 2
