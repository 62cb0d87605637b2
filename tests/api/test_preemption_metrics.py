"""Issue 12 item 10: preemptions (KV cache too small for the load) are visible to an operator, as
``num_preemptions`` in ``/health`` and ``streamproxy:num_preemptions_total`` in ``/metrics``, with the
real engine (tiny random Llama) over a KV pool too small for four concurrent requests."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.settings import Settings

from .fakes import make_tiny_model
from .real_app import real_app

NAME = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-preempt") / "tiny-llama"
    make_tiny_model(folder)
    return folder


def _counter(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


def test_preemptions_in_health_and_metrics(model_dir: Path) -> None:
    # 16 blocks of 4 tokens = 64 KV slots; four requests of 28 prompt + 24 generated tokens need 208.
    settings = Settings(model=str(model_dir), served_model_name=NAME, num_kv_blocks=16, block_size=4,
                        num_threads=1, device="cpu", dtype="float32", self_check=False)

    async def main():
        async with real_app(settings) as (client, _):
            before = (await client.get("/health")).json()
            before_metric = _counter((await client.get("/metrics")).text, "streamproxy:num_preemptions_total")
            body = {"model": NAME, "messages": [{"role": "user", "content": "Hello there, how are you"}],
                    "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            posts = [client.post("/v1/chat/completions", json=body) for _ in range(4)]
            replies = await asyncio.gather(*posts)
            after = (await client.get("/health")).json()
            metric = _counter((await client.get("/metrics")).text, "streamproxy:num_preemptions_total")
            return before, before_metric, replies, after, metric

    before, before_metric, replies, after, metric = asyncio.run(main())
    assert before["num_preemptions"] == 0 and before_metric == 0
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert all(
        r.json()["usage"]["completion_tokens"] == 24 for r in replies
    )  # preempted requests still finish
    assert after["num_preemptions"] > 0
    assert metric == after["num_preemptions"]
