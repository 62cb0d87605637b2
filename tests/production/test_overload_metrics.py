"""The real engine (tiny random Llama) in-process: the bounded waiting queue (429 + Retry-After while
admitted requests finish with their exact text) and the Prometheus metrics moving with requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.api.app import create_app

from .helpers import TINY, chunks_and_done, make_tiny_model, stream_text, tiny_settings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-overload") / "tiny")


async def with_app(settings, fn):
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        state = app.state.server
        while state.status == "loading":
            await asyncio.sleep(0.01)
        assert state.status == "ready", state.load_error
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=120) as client:
            return await fn(client)


PROMPTS = ["Hello", "The quick brown fox", "alpha beta gamma", "你好，世界"]


def body(prompt: str, **kw) -> dict:
    return {"model": TINY, "prompt": prompt, "temperature": 0, "ignore_eos": True, "max_tokens": 1000, **kw}


def test_queue_full_is_429_and_admitted_requests_finish_exactly(model_dir: Path):
    settings = tiny_settings(model_dir, max_num_seqs=2, max_waiting=2)

    async def scenario(client: httpx.AsyncClient):
        refs = []
        for pair in (PROMPTS[:2], PROMPTS[2:]):
            rs = await asyncio.gather(*[client.post("/v1/completions", json=body(p)) for p in pair])
            refs += [r.json()["choices"][0]["text"] for r in rs]

        async def until(running: int, waiting: int) -> None:
            for _ in range(2000):
                h = (await client.get("/health")).json()
                if h["num_running"] == running and h["num_waiting"] == waiting:
                    return
                await asyncio.sleep(0.002)
            raise AssertionError(h)

        admitted = []
        for i, p in enumerate(PROMPTS):  # 2 running, then 2 waiting: the queue is full
            admitted.append(
                asyncio.create_task(client.post("/v1/completions", json=body(p, stream=i % 2 == 0)))
            )
            await until(min(i + 1, 2), max(0, i - 1))
        flood = await asyncio.gather(*[client.post("/v1/completions", json=body("Hello", stream=i % 2 == 0))
                                       for i in range(24)])
        done = await asyncio.gather(*admitted)
        metrics = (await client.get("/metrics")).text
        return refs, flood, done, metrics

    refs, flood, done, metrics = asyncio.run(with_app(settings, scenario))
    assert all(len(r) > 20 for r in refs)
    for r in flood:
        assert r.status_code == 429
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    for i, (r, ref) in enumerate(zip(done, refs)):
        assert r.status_code == 200, (i, r.text[:300])
        text = (
            stream_text(chunks_and_done(r.content), chat=False)
            if i % 2 == 0
            else r.json()["choices"][0]["text"]
        )
        assert text == ref
    assert sample(metrics, "streamproxy:request_rejected_total", reason="queue_full") == 24
    # refused requests are counted as rejected, not as finished (aborted) ones
    assert sample(metrics, "streamproxy:request_success_total", finished_reason="length") == 8
    with pytest.raises(KeyError):
        sample(metrics, "streamproxy:request_success_total", finished_reason="abort")


def sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def test_metrics_move_with_requests(model_dir: Path):
    settings = tiny_settings(model_dir)

    async def scenario(client: httpx.AsyncClient):
        before = (await client.get("/metrics")).text
        long = asyncio.create_task(client.post("/v1/completions", json=body("Hello", max_tokens=6000,
                                                                            stream=True)))
        for _ in range(2000):
            h = (await client.get("/health")).json()
            if h["num_running"] == 1 and h["num_free_blocks"] < h["num_total_blocks"] - 2:
                break
            await asyncio.sleep(0.002)
        during = (await client.get("/metrics")).text
        await long
        plain = [
            (await client.post("/v1/completions", json=body(p, max_tokens=8))).json() for p in PROMPTS[:2]
        ]
        ref = plain[0]["choices"][0]["text"]
        stop = ref[3:5]
        stopped = (await client.post("/v1/completions", json=body("Hello", max_tokens=8, stop=[stop]))).json()
        for _ in range(500):  # the stop string's engine abort is applied before the engine's next step
            h = (await client.get("/health")).json()
            if h["num_running"] == 0 and h["num_free_blocks"] == h["num_total_blocks"]:
                break
            await asyncio.sleep(0.002)
        after = (await client.get("/metrics")).text
        return before, during, plain, stopped, after

    before, during, plain, stopped, after = asyncio.run(with_app(settings, scenario))
    names = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
             "request_queue_time_seconds"]
    for n in names:
        assert sample(before, f"streamproxy:{n}_count") == 0
    assert sample(before, "streamproxy:generation_tokens_total") == 0
    # while one stream runs
    assert sample(during, "streamproxy:num_requests_running") == 1
    assert sample(during, "streamproxy:num_requests_waiting") == 0
    assert 0 < sample(during, "streamproxy:kv_cache_usage_perc") < 1
    # after 4 requests: 1 long (length), 2 plain (length), 1 cut by a stop string
    assert stopped["choices"][0]["finish_reason"] == "stop"
    for n in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert sample(after, f"streamproxy:{n}_count") == 4
    gen = 6000 + 16 + stopped["usage"]["completion_tokens"]
    assert sample(after, "streamproxy:generation_tokens_total") == gen
    assert sample(after, "streamproxy:inter_token_latency_seconds_count") == gen - 4
    prompt_tokens = sum(p["usage"]["prompt_tokens"] for p in plain) + 2 * stopped["usage"]["prompt_tokens"]
    assert sample(after, "streamproxy:prompt_tokens_total") == prompt_tokens
    assert sample(after, "streamproxy:request_success_total", finished_reason="length") == 3
    assert sample(after, "streamproxy:request_success_total", finished_reason="stop") == 1
    assert sample(after, "streamproxy:num_requests_running") == 0
    assert sample(after, "streamproxy:kv_cache_usage_perc") == 0
    assert sample(after, "streamproxy:e2e_request_latency_seconds_sum") > 0
