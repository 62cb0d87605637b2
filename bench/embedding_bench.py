"""Embeddings beside decoding streams: does ``POST /v1/embeddings`` stall running streams?

Starts ``python -m proxy serve`` (the default model unless ``--model``; ``--embedding-model`` or, by
default, the chat model embedding itself) on a free port of 127.0.0.1, then runs three phases:

1. ``streams``: ``--streams`` chat streams decode ``--max-tokens`` tokens each (``ignore_eos``);
2. ``embeddings``: ``--num-texts`` short texts embedded alone, in requests of ``--batch`` texts, all
   sent at once;
3. ``both``: the streams again, and once every stream has its first token, the same embeddings.

Per phase it prints texts/s (embedded texts over the time from the first embeddings request to the
last answer) and, of the streams, the mean TPOT (per stream: (last - first token) / (tokens - 1),
averaged), the p99 inter-token latency over all streams' gaps, their ratio, and the p99 of the gaps
that fall inside the embedding window (``both``). A JSON line per phase follows, for docs/.
Not a test: figures depend on the machine; ``docs/embeddings.md`` records a run.

    .venv/bin/python bench/embedding_bench.py --streams 8 --num-texts 256
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from proxy.ports import start_serve

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "rain", "falls",
         "on", "the", "river", "near", "the", "old", "city", "and", "a", "cat", "reads", "a", "book", "about",
         "search", "vectors"]


def texts(n: int) -> list[str]:
    """``n`` distinct short texts (6-12 words)."""
    return [" ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(6 + i % 7)) for i in range(n)]


async def stream(client: httpx.AsyncClient, model: str, max_tokens: int, first: asyncio.Event,
                 started: list[int], num_streams: int) -> list[float]:
    """One chat stream; returns the arrival times (monotonic s) of its content chunks."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story about a fox."}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
    times: list[float] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        buffer = b""
        async for raw in resp.aiter_raw():
            buffer += raw
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                chunk = json.loads(event[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    times.append(time.monotonic())
                    if len(times) == 1:
                        started[0] += 1
                        if started[0] == num_streams:
                            first.set()
    return times


async def embed_all(client: httpx.AsyncClient, model: str, items: list[str],
                    batch: int, encoding_format: str = "float") -> tuple[float, float]:
    """Embed ``items`` in requests of ``batch``, all in flight at once; returns (start, end) times."""
    start = time.monotonic()

    async def one(part: list[str]) -> None:
        resp = await client.post("/v1/embeddings", json={"model": model, "input": part,
                                                          "encoding_format": encoding_format})
        resp.raise_for_status()
        # orjson: the standard library's parser would hold this loop (which stamps the streams'
        # chunks) ~7 ms per 32 float vectors of 576
        assert len(orjson.loads(resp.content)["data"]) == len(part)

    await asyncio.gather(*(one(items[i:i + batch]) for i in range(0, len(items), batch)))
    return start, time.monotonic()


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def stream_figures(runs: list[list[float]], window: tuple[float, float] | None) -> dict[str, float]:
    gaps = [(b - a, b) for times in runs for a, b in itertools.pairwise(times)]
    tpot = statistics.mean((t[-1] - t[0]) / (len(t) - 1) for t in runs if len(t) > 1)
    out = {"mean_tpot_ms": 1000 * tpot, "p99_itl_ms": 1000 * p99([g for g, _ in gaps])}
    out["p99_itl_over_mean_tpot"] = out["p99_itl_ms"] / out["mean_tpot_ms"]
    if window is not None:
        inside = [g for g, end in gaps if window[0] <= end <= window[1]]
        out["p99_itl_in_embedding_window_ms"] = 1000 * p99(inside)
        out["gaps_in_embedding_window"] = len(inside)
    return out


async def phase(base: str, chat: str, embedder: str, args: argparse.Namespace, *, streams: bool,
                embeddings: bool) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        first, started = asyncio.Event(), [0]
        tasks = [asyncio.create_task(stream(client, chat, args.max_tokens, first, started, args.streams))
                 for _ in range(args.streams if streams else 0)]
        out: dict[str, float] = {}
        window = None
        if embeddings:
            if streams:
                await first.wait()
            window = await embed_all(client, embedder, texts(args.num_texts), args.batch,
                                     args.encoding_format)
            out["texts_per_s"] = args.num_texts / (window[1] - window[0])
        runs = await asyncio.gather(*tasks)
        if runs:
            out.update(stream_figures(list(runs), window))
        if args.dump:  # after the phase: nothing is timed any more
            line = json.dumps({"streams": streams, "embeddings": embeddings, "runs": list(runs),
                               "window": window}) + "\n"
            with Path(args.dump).open("a") as fh:  # noqa: ASYNC230
                fh.write(line)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--embedding-model", default=None)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-texts", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--encoding-format", choices=("float", "base64"), default="float",
                    help="of the embeddings requests (float: the API's default; the OpenAI SDK asks base64)")
    ap.add_argument("--dump", default=None, help="append each phase's raw chunk times (JSON lines) here")
    ap.add_argument("--serve-args", default="--num-threads 2 --no-engine-process",
                    help="extra arguments of `proxy serve`")
    args = ap.parse_args()
    serve_args = args.serve_args.split()
    if args.model:
        serve_args += ["--model", args.model]
    if args.embedding_model:
        serve_args += ["--embedding-model", args.embedding_model, "--served-embedding-model-name", "embedder"]
    server = start_serve(serve_args, Path(tempfile.mkstemp(suffix=".log")[1]))
    base = server.base_url
    try:
        cards = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
        chat, embedder = cards[0]["id"], cards[-1]["id"]
        warm = httpx.post(f"{base}/v1/embeddings", json={"model": embedder, "input": texts(8)}, timeout=600)
        warm.raise_for_status()  # the chat model's embedding copy loads at the first request
        width = len(warm.json()["data"][0]["embedding"])
        print(f"cmd: serve {' '.join(serve_args)}; embedder {embedder}, dimensions {width}")
        for name, kw in (("streams", {"streams": True, "embeddings": False}),
                         ("embeddings", {"streams": False, "embeddings": True}),
                         ("both", {"streams": True, "embeddings": True})):
            figures = asyncio.run(phase(base, chat, embedder, args, **kw))
            print(json.dumps({"phase": name, **{k: round(v, 3) for k, v in figures.items()}}), flush=True)
    finally:
        server.stop(30.0)


if __name__ == "__main__":
    main()
