"""Bounded soak test (about 60 s, loopback only), run alone: ``pytest -m soak tests/production/test_soak.py
-s``.

64 concurrent clients stream from a real server with the default model for SOAK_S seconds: some
disconnect at a random point, some read slowly, the rest read normally (and a few ask non-stream).
Checks: no unhandled exception in the server log, every KV block back at the end, RSS growth under
5% between the first and last 10 s, and every completed response equals the non-stream reference
text of the same (prompt, seed, max_tokens).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx
import pytest

from .helpers import Proc, chunks_and_done, start_server, stream_text

SOAK_S = 60.0
CLIENTS = 64
PROMPTS = ["Write a haiku about the sea.", "What is 2 + 2?", "Name three colors.", "Tell me a short joke.",
           "Say hello in French.", "What is the capital of Japan?", "Describe a cat in one sentence.",
           "Count from one to five."]
SPECS = [(p, seed, 24 + 8 * (seed % 3)) for p in PROMPTS for seed in (1, 2)]  # 16 distinct requests


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def body(model: str, spec: tuple[str, int, int], stream: bool) -> dict:
    prompt, seed, max_tokens = spec
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0.8,
            "seed": seed, "max_tokens": max_tokens, "stream": stream}


@pytest.mark.soak
def test_soak(tmp_path: Path):
    proc = start_server(tmp_path, ["--num-threads", "2", "--max-num-seqs", "32", "--max-waiting", "256",
                                   "--kv-cache-bytes", str(256 << 20)])
    try:
        figures = asyncio.run(_soak(proc))
    finally:
        code = proc.stop(60)
    figures["exit_code"] = code
    print("\nSOAK FIGURES " + json.dumps(figures, indent=1))
    (tmp_path / "soak.json").write_text(json.dumps(figures, indent=1))
    log = proc.log()
    for needle in ("Traceback", "ERROR", "Exception"):
        assert needle not in log, log[-4000:]
    assert code == 0
    assert figures["mismatches"] == [], figures["mismatches"][:3]
    assert figures["completed_streams"] > 100 and figures["disconnected"] > 20
    assert figures["end_free_blocks"] == figures["total_blocks"]
    assert figures["end_tracked_outputs"] == 0
    assert figures["rss_growth_pct"] < 5.0


async def _soak(proc: Proc) -> dict:
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8)
    async with httpx.AsyncClient(base_url=proc.base_url, timeout=300, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        refs = {}
        for spec, r in zip(
            SPECS,
            await asyncio.gather(
                *[client.post("/v1/chat/completions", json=body(model, s, False)) for s in SPECS]
            ),
        ):
            refs[spec] = r.json()["choices"][0]["message"]["content"]
        stats = {"completed_streams": 0, "completed_plain": 0, "disconnected": 0, "slow": 0, "rejected": 0,
                 "chunks": 0}
        mismatches: list = []
        rss: list[tuple[float, int]] = []
        t0 = time.monotonic()
        deadline = t0 + SOAK_S

        async def sample_rss() -> None:
            while time.monotonic() < deadline:
                rss.append((time.monotonic() - t0, rss_bytes(proc.process.pid)))
                await asyncio.sleep(0.5)

        async def worker(i: int) -> None:
            r = random.Random(i)
            while time.monotonic() < deadline:
                spec = r.choice(SPECS)
                mode = r.random()
                if mode < 0.1:
                    resp = await client.post("/v1/chat/completions", json=body(model, spec, False))
                    if resp.status_code == 429:
                        stats["rejected"] += 1
                        await asyncio.sleep(1)
                        continue
                    text = resp.json()["choices"][0]["message"]["content"]
                    stats["completed_plain"] += 1
                    if text != refs[spec]:
                        mismatches.append((spec, "plain", text, refs[spec]))
                    continue
                disconnect_after = r.randint(1, 12) if mode < 0.35 else None
                slow = 0.35 <= mode < 0.55
                raw = b""
                async with client.stream(
                    "POST", "/v1/chat/completions", json=body(model, spec, True)
                ) as resp:
                    if resp.status_code == 429:
                        stats["rejected"] += 1
                        await resp.aread()
                        await asyncio.sleep(1)
                        continue
                    n = 0
                    async for piece in resp.aiter_raw():
                        raw += piece
                        n += 1
                        if slow:
                            await asyncio.sleep(r.uniform(0.05, 0.3))
                        if disconnect_after is not None and n >= disconnect_after:
                            break
                stats["chunks"] += n
                if disconnect_after is not None and not raw.endswith(b"data: [DONE]\n\n"):
                    stats["disconnected"] += 1
                    continue
                stats["slow"] += slow
                stats["completed_streams"] += 1
                text = stream_text(chunks_and_done(raw))
                if text != refs[spec]:
                    mismatches.append((spec, "stream", text, refs[spec]))

        await asyncio.gather(sample_rss(), *[worker(i) for i in range(CLIENTS)])
        elapsed = time.monotonic() - t0
        health = {}
        for _ in range(200):
            health = (await client.get("/health")).json()
            if health["num_running"] == 0 and health["num_free_blocks"] == health["num_total_blocks"] \
                    and health["num_tracked_outputs"] == 0:
                break
            await asyncio.sleep(0.05)
        metrics = (await client.get("/metrics")).text
    first = [v for t, v in rss if t <= 10.0]
    last = [v for t, v in rss if t >= rss[-1][0] - 10.0]
    rss_first, rss_last = statistics.mean(first), statistics.mean(last)
    gen_line = next(
        line for line in metrics.splitlines() if line.startswith("streamproxy:generation_tokens_total")
    )
    return {
        **stats,
        "elapsed_s": round(elapsed, 1),
        "mismatches": mismatches,
        "end_free_blocks": health["num_free_blocks"],
        "total_blocks": health["num_total_blocks"],
        "end_tracked_outputs": health["num_tracked_outputs"],
        "rss_first10s_mib": round(rss_first / 2**20, 1),
        "rss_last10s_mib": round(rss_last / 2**20, 1),
        "rss_growth_pct": round(100.0 * (rss_last - rss_first) / rss_first, 2),
        "generation_tokens_total": float(gen_line.split()[-1]),
    }
