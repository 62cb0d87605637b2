"""End-to-end over a real uvicorn with the default model: OpenAI SDK, LangChain, raw SSE, disconnects."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from proxy.api.streaming import KEEPALIVE

from .server import Server, sse_chunks

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def test_openai_sdk_sync_stream_equals_non_stream(server: Server):
    import openai

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    full = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    # the counts agree; prompt_tokens_details may not (the second request's prompt hits the prefix cache)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(usage, k) for k in counts] == [getattr(full.usage, k) for k in counts]
    assert full.usage.prompt_tokens_details is not None and usage.prompt_tokens_details is not None
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]


def test_openai_sdk_async_and_completions(server: Server):
    import openai

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        full, stream = await asyncio.gather(
            client.completions.create(model=server.model, prompt="The capital of France is", max_tokens=8,
                                      temperature=0),
            client.completions.create(model=server.model, prompt="The capital of France is", max_tokens=8,
                                      temperature=0, stream=True),
        )
        parts = [c.choices[0].text async for c in stream]
        chat = await client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=8,
                                                    temperature=0)
        chat_stream = await client.chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
        )
        chat_parts = [c.choices[0].delta.content or "" async for c in chat_stream]
        return full, parts, chat, chat_parts

    full, parts, chat, chat_parts = asyncio.run(main())
    assert "".join(parts) == full.choices[0].text and full.usage.completion_tokens == 8
    assert "".join(chat_parts) == chat.choices[0].message.content


def test_openai_sdk_raises_on_bad_request(server: Server):
    import openai

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=[], max_tokens=4)
    assert info.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=4)


def test_langchain_invoke_and_stream(server: Server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", model=server.model, temperature=0,
                     max_tokens=12)
    full = llm.invoke("Name three colours.")
    pieces = list(llm.stream("Name three colours."))
    assert "".join(p.content for p in pieces) == full.content and full.content
    assert full.usage_metadata["output_tokens"] >= 1


def test_raw_sse_bytes_and_headers(server: Server):
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
        raw = b"".join(r.iter_raw())
    chunks = sse_chunks(raw)
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    # A first token later than stream_headers_timeout_s (1 s: a loaded machine) sends the headers with
    # ": keepalive" comments first; they are the only bytes allowed besides the events.
    while raw.startswith(KEEPALIVE):
        raw = raw[len(KEEPALIVE):]
    canonical = (
        b"".join(
            b"data: " + json.dumps(c, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
            for c in chunks
        )
        + b"data: [DONE]\n\n"
    )
    assert raw == canonical  # compact JSON, one event per chunk, nothing else


def _post_raw(server: Server, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def _wait_idle(server: Server, timeout: float) -> float:
    t0 = time.monotonic()
    while True:
        h = server.health()
        if h["num_running"] == 0 and h["num_waiting"] == 0 and h["num_free_blocks"] == h["num_total_blocks"]:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout, h
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_blocks(server: Server, stream: bool):
    _wait_idle(server, 30)
    body = {"model": server.model, "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": 2000, "ignore_eos": True, "temperature": 0.7, "stream": stream}
    sock = _post_raw(server, body)
    if stream:
        buf = b""
        while b'"content":"' not in buf.split(b'"role":"assistant"', 1)[-1]:
            chunk = sock.recv(65536)
            assert chunk
            buf += chunk
    else:
        t0 = time.monotonic()
        while server.health()["num_running"] == 0:
            assert time.monotonic() - t0 < 30
            time.sleep(0.02)
        time.sleep(0.5)
    assert server.health()["num_running"] == 1
    sock.close()
    assert _wait_idle(server, 1.0) < 1.0


def test_health_server_info_and_the_log_show_the_execution_plan(server: Server):
    """Which kernels serve the steps (``proxy.engine.execution.plan``): one log line before the ready
    line, the same plan under ``execution`` in ``/health`` and ``/server_info`` (the engine process's
    too)."""
    health = server.health()["execution"]
    info = httpx.get(f"{server.base_url}/server_info", timeout=10).json()["execution"]
    assert health == info
    assert info["step"] in ("compiled", "eager") and info["device"] == "cpu"
    assert (info["step"] == "compiled") is ("compiled" not in info["off"])
    assert info["linears"] and all(n > 0 for n in info["linears"].values())
    log = server.log_path.read_text(errors="replace")
    at = log.index(info["summary"])
    assert 0 <= at < log.index("streamproxy ready")
