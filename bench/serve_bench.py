"""Serving benchmark for any OpenAI-compatible streaming server.

A load generator in the manner of ``vllm bench serve`` (vllm/benchmarks/serve.py): it sends streamed
chat (or text) completion requests to a URL, records per-request timings on the client, and writes a
JSON result whose field names are the ones ``vllm bench serve`` writes (``completed``,
``total_output_tokens``, ``request_throughput``, ``output_throughput``, ``mean_ttft_ms``,
``median_ttft_ms``, ``p99_ttft_ms``, ``mean_tpot_ms``, ``mean_itl_ms``, ``mean_e2el_ms``, ...), so
the numbers can be read side by side with vLLM's.

Load modes:
- fixed concurrency: ``--max-concurrency 1,4,8,16,32`` runs one benchmark per level (a sweep), each
  keeping exactly N requests in flight (closed loop, ``--request-rate inf``);
- Poisson arrivals: ``--request-rate 2,4`` sends requests at that mean rate (req/s), inter-arrival
  times drawn from a gamma distribution with shape ``--burstiness`` (1.0 = Poisson process, as vLLM),
  optionally capped by a single ``--max-concurrency``.

Datasets:
- ``random``: fixed input/output lengths. The prompt is ``--random-input-len`` tokens of random
  vocabulary (with ``--tokenizer DIR``, a local folder; never a hub id) or of common English words
  (about one token each) without one; ``max_tokens = --random-output-len`` and, so that every request
  really generates that many tokens, ``--eos-strategy`` adds ``ignore_eos: true`` (vLLM, llama.cpp),
  ``min_tokens`` (vLLM), or a ``logit_bias`` of -100 on the EOS ids (any server honouring OpenAI's
  ``logit_bias``).
- ``conversational``: the short chat requests of ``bench/prompts/conversational.jsonl`` (natural
  output lengths, capped by ``--max-tokens``; a fixed set, the same at every load point).
- ``--image-size N`` (random and conversational): each request's last user message carries one
  generated ``N`` x ``N`` PNG as a data URL after its text (:func:`bench_image_url`: a fixed picture,
  the same bytes for every server; ``--image-unique`` stamps the request's number into it, so that no
  encoder or prefix cache can answer one request's image from another's). ``prompt_len`` counts the
  text only.
- ``multiturn``: chat conversations that grow turn by turn, as chat apps resend them: a shared
  system prompt of ``--multiturn-system-len`` words (``--multiturn-unique-system``: one of its own
  per conversation, so that every turn 1 computes it), then ``--multiturn-turns`` user messages of
  ``--multiturn-user-len`` words, each request carrying the whole conversation so far (the earlier
  replies are the server's own text) and asking for ``--random-output-len`` tokens. A conversation
  holds one of the ``--max-concurrency`` slots for all its turns; ``--num-prompts`` counts
  conversations. Reported besides the usual fields: TTFT per turn (``ttft_by_turn``), the mean TTFT
  of turn 1 and of the later turns and their ratio, and the prefix-cache hit rate
  (``prefix_cache_hit_rate``: cached / prompt tokens, from ``usage.prompt_tokens_details
  .cached_tokens`` or llama-server's ``timings.cache_n``; None when the server reports neither).

Fresh prompts: every load point (and its warm-up) gets prompts of its own (the seed is varied per
point), so a server's prefix or prompt cache cannot answer a point from an earlier one; pass
``--reuse-prompts`` to send the same prompts at every point (the old behaviour, which measures a
warm prompt cache).

Metrics (all from client-side ``time.perf_counter()`` timestamps, definitions as in vLLM):
- TTFT: request sent -> first chunk carrying non-empty content (not the role-only chunk);
- ITL: the gaps between consecutive content chunks of a request (a chunk holding several tokens is one
  gap, as in vLLM);
- TPOT: ``(e2e latency - TTFT) / (output tokens - 1)`` per request with more than one output token;
- E2EL: request sent -> end of the stream;
- output tokens: ``usage.completion_tokens`` (``stream_options.include_usage``); when a server sends no
  usage, the local tokenizer's count of the generated text, else the number of content chunks;
- request_throughput = completed / duration, output_throughput = output tokens / duration (tok/s).
Each latency metric gets mean, median, std and the ``--percentiles`` (default 90, 99).

Outputs (``--result-dir``): ``<label>-c<N>.json`` or ``<label>-r<R>.json`` per load point (the vLLM
result dict plus the run configuration), ``<label>.json`` with all points, and ``<label>.png``
(latency CDFs and output throughput vs load). ``python bench/serve_bench.py plot A.json B.json
--out cmp.png`` overlays several servers' summaries.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
CONVERSATIONAL_PATH = PROMPTS_DIR / "conversational.jsonl"
DEFAULT_PERCENTILES = (90.0, 99.0)
METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")

# Common English words; outside a tokenizer each is about one BPE token with its leading space.
_WORDS = [
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "are", "with", "as", "at", "be", "by", "this",
    "had", "not", "but", "from", "have", "they", "which", "one", "you", "were", "her", "all", "she",
    "there", "would", "their", "we", "him", "been", "has", "when", "who", "will", "more", "no", "if", "out",
    "so", "said", "what", "up", "its", "about", "into", "than", "them", "can", "only", "other", "new",
    "some", "could", "time", "these", "two", "may", "then", "do", "first", "any", "my", "now", "such",
    "like", "our", "over", "man", "me", "even", "most", "made", "after", "also", "did", "many", "before",
    "must", "through", "back", "years", "where", "much", "your", "way", "well", "down", "should", "because",
    "each", "just", "those", "people", "how", "too", "little", "state", "good", "very", "make", "world",
    "still", "own", "see", "men", "work", "long", "get", "here", "between", "both", "life", "being",
    "under", "never", "day", "same", "another", "know", "while", "last", "might", "us", "great", "old",
    "year", "off", "come", "since", "against", "go", "came", "right", "used", "take", "three",
]


# --------------------------------------------------------------------------------------------------
# Requests and results


@dataclass
class SampleRequest:
    """One request of a dataset.

    ``messages`` are OpenAI chat messages; ``prompt_len`` is the local tokenizer's count of the prompt
    text (None without a tokenizer); ``max_tokens`` is the ``max_tokens`` sent; ``fixed_output`` says the
    request asks the server to generate exactly ``max_tokens`` (random dataset with an EOS strategy).
    """

    messages: list[dict[str, Any]]
    max_tokens: int
    prompt_len: int | None = None
    fixed_output: bool = False


@dataclass
class RequestResult:
    """Client-side measurements of one streamed request. Times in seconds (``time.perf_counter``).

    ``ttft`` is 0.0 and ``itl`` empty when no content arrived; ``prompt_tokens``/``output_tokens`` are
    the server's ``usage`` (None when it sent none); ``cached_tokens`` the prompt tokens the server
    says it served from its prefix cache (``usage.prompt_tokens_details.cached_tokens`` or
    llama-server's ``timings.cache_n``; None when not reported); ``num_content_chunks`` counts SSE
    chunks with non-empty content; ``turn`` is the 1-based turn of a multi-turn request (0 otherwise).
    """

    success: bool = False
    error: str = ""
    start_time: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    num_content_chunks: int = 0
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    local_prompt_len: int | None = None
    cached_tokens: int | None = None
    turn: int = 0
    retries: int = 0


# --------------------------------------------------------------------------------------------------
# Metric math (pure; unit-tested with exact values)


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/p<P> of ``values_s`` (seconds) in milliseconds, keys as vLLM names them.

    An empty list gives zeros (vLLM does ``np.mean(values or 0)``). Percentiles use numpy's default
    linear interpolation, as vLLM does.
    """
    arr = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    out = {
        f"mean_{name}_ms": float(np.mean(arr)),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(np.std(arr)),
    }
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def output_token_count(result: RequestResult, count_tokens: Callable[[str], int] | None = None) -> int:
    """Output tokens of one request: server ``usage`` first, then the local tokenizer, then chunks."""
    if result.output_tokens is not None:
        return int(result.output_tokens)
    if count_tokens is not None:
        return count_tokens(result.generated_text)
    return result.num_content_chunks


def calculate_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    count_tokens: Callable[[str], int] | None = None,
) -> dict[str, Any]:
    """Aggregate per-request results into the ``vllm bench serve`` result fields.

    Args:
        results: one entry per request, failed ones included.
        duration_s: wall time of the whole load point, seconds (first send -> last stream end).
        percentiles: which percentiles to report, e.g. ``(90, 99)`` -> ``p90_ttft_ms``, ``p99_ttft_ms``.
        count_tokens: optional text -> token count, used only when a server sends no ``usage``.

    Returns:
        dict with ``duration``, ``completed``, ``failed``, ``total_input_tokens``,
        ``total_output_tokens``, ``request_throughput`` (req/s), ``output_throughput`` (tok/s),
        ``total_token_throughput`` (tok/s), ``mean/median/std/p*_{ttft,tpot,itl,e2el}_ms``,
        ``max_concurrent_requests``, ``retried`` (requests sent again because the server never
        answered them: :func:`send_request`) and the per-request lists ``input_lens``, ``output_lens``,
        ``ttfts``, ``itls``, ``latencies``, ``start_times``, ``errors`` (seconds, as vLLM writes them).
        TPOT of a request is ``(latency - ttft) / (output_len - 1)``, only for output_len > 1.

    Raises:
        ValueError: if ``duration_s`` is not positive.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    input_lens: list[int] = []
    output_lens: list[int] = []
    completed = 0
    for r in results:
        in_len = r.prompt_tokens if r.prompt_tokens is not None else (r.local_prompt_len or 0)
        input_lens.append(int(in_len))
        if not r.success:
            output_lens.append(0)
            continue
        completed += 1
        out_len = output_token_count(r, count_tokens)
        output_lens.append(out_len)
        ttfts.append(r.ttft)
        e2els.append(r.latency)
        itls.extend(r.itl)
        if out_len > 1:
            tpots.append((r.latency - r.ttft) / (out_len - 1))
    total_input = sum(n for n, r in zip(input_lens, results) if r.success)
    total_output = sum(output_lens)
    metrics: dict[str, Any] = {
        "duration": duration_s,
        "completed": completed,
        "failed": len(results) - completed,
        "retried": sum(r.retries for r in results),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_concurrent_requests": peak_concurrency(results),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        metrics.update(_stats(name, values, percentiles))
    metrics.update(
        {
            "input_lens": input_lens,
            "output_lens": output_lens,
            "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results],
            "latencies": [r.latency for r in results],
            "start_times": [r.start_time for r in results],
            "finish_reasons": [r.finish_reason for r in results],
            "errors": [r.error for r in results],
        }
    )
    return metrics


def prefix_cache_hit_rate(results: Sequence[RequestResult]) -> float | None:
    """Cached / prompt tokens over the successful requests that report both; None when none does."""
    reported = [r for r in results if r.success and r.cached_tokens is not None and r.prompt_tokens]
    if not reported:
        return None
    return sum(int(r.cached_tokens or 0) for r in reported) / sum(int(r.prompt_tokens or 0) for r in reported)


def turn_metrics(
    results: Sequence[RequestResult], percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> dict[str, Any]:
    """TTFT per conversation turn of a multi-turn run (successful requests with ``turn >= 1``).

    Returns:
        ``ttft_by_turn``: ``{turn: {mean_ttft_ms, median_ttft_ms, p*_ttft_ms, count}}``;
        ``mean_ttft_turn1_ms``, ``mean_ttft_later_turns_ms`` (turns >= 2) and
        ``ttft_later_over_turn1`` (their ratio; None without both). Empty when no request has a turn.
    """
    by_turn: dict[int, list[float]] = {}
    for r in results:
        if r.success and r.turn >= 1:
            by_turn.setdefault(r.turn, []).append(r.ttft)
    if not by_turn:
        return {}
    table: dict[int, dict[str, float]] = {}
    for turn in sorted(by_turn):
        stats = _stats("ttft", by_turn[turn], percentiles)
        stats.pop("std_ttft_ms")
        table[turn] = {**stats, "count": len(by_turn[turn])}
    first = by_turn.get(1, [])
    later = [t for turn, v in by_turn.items() if turn >= 2 for t in v]
    mean1 = float(np.mean(first)) * 1000 if first else None
    mean2 = float(np.mean(later)) * 1000 if later else None
    return {
        "ttft_by_turn": table,
        "mean_ttft_turn1_ms": mean1,
        "mean_ttft_later_turns_ms": mean2,
        "ttft_later_over_turn1": (mean2 / mean1) if mean1 and mean2 is not None else None,
    }


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most successful requests in flight at once, over half-open intervals [start, start+latency)."""
    events: list[tuple[float, int]] = []
    for r in results:
        if r.success:
            events.append((r.start_time, 1))
            events.append((r.start_time + r.latency, -1))
    events.sort()  # at equal times -1 sorts before +1: an arrival at another's end does not overlap
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


# --------------------------------------------------------------------------------------------------
# Datasets


def load_tokenizer(path: str | None) -> Any:
    """A transformers tokenizer from a local folder (``local_files_only``), or None."""
    if not path:
        return None
    if not Path(path).is_dir():
        raise SystemExit(f"--tokenizer must be a local folder, got {path!r}")
    from transformers import AutoTokenizer  # imported lazily: the benchmark itself needs no torch

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def random_requests(
    num: int, input_len: int, output_len: int, seed: int, tokenizer: Any = None, fixed_output: bool = True,
    no_added_tokens: bool = False,
) -> list[SampleRequest]:
    """``num`` single-message chat requests of about ``input_len`` prompt tokens each.

    With a tokenizer: random non-special vocabulary ids, decoded, re-encoded and cut to exactly
    ``input_len`` tokens (vLLM's random dataset does the same); ``no_added_tokens``: none of the
    tokenizer's added tokens either (a vision model's image tokens, which a processor would take for
    images). Without: ``input_len`` random common English words. A per-request prefix (its index)
    keeps prompts distinct so no prefix cache hides the prefill.
    """
    rng = random.Random(seed)
    reqs: list[SampleRequest] = []
    if tokenizer is not None:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        if no_added_tokens:
            special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        vocab = [i for i in range(len(tokenizer)) if i not in special]
    for i in range(num):
        if tokenizer is not None:
            ids = [rng.choice(vocab) for _ in range(input_len)]
            text = f"{i}: " + tokenizer.decode(ids)
            ids = tokenizer.encode(text, add_special_tokens=False)[:input_len]
            text = tokenizer.decode(ids)
            prompt_len: int | None = len(tokenizer.encode(text, add_special_tokens=False))
        else:
            text = f"{i}: " + " ".join(rng.choice(_WORDS) for _ in range(max(input_len - 2, 1)))
            prompt_len = None
        reqs.append(
            SampleRequest(
                messages=[{"role": "user", "content": text}],
                max_tokens=output_len,
                prompt_len=prompt_len,
                fixed_output=fixed_output,
            )
        )
    return reqs


def conversational_requests(
    num: int, max_tokens: int, tokenizer: Any = None, path: Path = CONVERSATIONAL_PATH
) -> list[SampleRequest]:
    """``num`` requests cycling over the conversational prompt set (file order)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"no prompts in {path}")
    reqs = []
    for i in range(num):
        msgs = rows[i % len(rows)]["messages"]
        plen = None
        if tokenizer is not None:
            plen = len(tokenizer.encode(" ".join(m["content"] for m in msgs), add_special_tokens=False))
        reqs.append(SampleRequest(messages=msgs, max_tokens=max_tokens, prompt_len=plen))
    return reqs


@dataclass
class Conversation:
    """One multi-turn chat: a system prompt and the user messages of its turns (replies come from
    the server as the conversation runs)."""

    system: str
    user_turns: list[str]
    max_tokens: int
    fixed_output: bool = True


def multiturn_conversations(
    num: int,
    turns: int,
    system_len: int,
    user_len: int,
    output_len: int,
    seed: int,
    fixed_output: bool = True,
    shared_system: bool = True,
) -> list[Conversation]:
    """``num`` conversations sharing one system prompt of ``system_len`` common English words (about
    one token each; an agent's or a chat app's fixed preamble), each with ``turns`` user messages of
    ``user_len`` words. ``shared_system=False``: each conversation has a system prompt of its own
    (a user's own instructions or memory), so its first turn computes the whole prompt on any
    server. Everything is drawn from ``seed``, so another seed gives another system prompt (fresh
    prompts per load point)."""
    rng = random.Random(seed)

    def system_prompt(tag: str) -> str:
        words = " ".join(rng.choice(_WORDS) for _ in range(system_len))
        return f"[{tag}] You are a helpful assistant. {words}"

    system = system_prompt(str(seed))
    convs = []
    for c in range(num):
        if not shared_system:
            system = system_prompt(f"{seed}.{c}")
        msgs = [f"({c}.{t}) " + " ".join(rng.choice(_WORDS) for _ in range(max(user_len - 2, 1)))
                for t in range(1, turns + 1)]
        convs.append(Conversation(system, msgs, output_len, fixed_output))
    return convs


# --------------------------------------------------------------------------------------------------
# The client


@dataclass
class ClientConfig:
    """How requests are sent. ``endpoint`` is ``/v1/chat/completions`` or ``/v1/completions``."""

    base_url: str
    model: str
    endpoint: str = "/v1/chat/completions"
    eos_strategy: str = "ignore_eos"  # ignore_eos | min_tokens | logit_bias | none
    eos_token_ids: tuple[int, ...] = ()
    stream_options: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0


def bench_image_url(size: int, variant: int | None = None) -> str:
    """A generated ``size`` x ``size`` RGB PNG as a ``data:image/png;base64,`` URL: a red / green
    gradient over a blue checkerboard of 32-pixel squares (detail for the encoder, the same bytes on
    every call); ``variant`` (not None) stamps its low 32 bits along the top edge as 8 x 8 black or
    white squares, so each variant is another image."""
    import base64
    import io

    img = _bench_image(size).copy()
    if variant is not None:
        for bit in range(min(32, size // 8)):
            shade = 255 if (variant >> bit) & 1 else 0
            img.paste((shade, shade, shade), (8 * bit, 0, 8 * bit + 8, 8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@functools.lru_cache(maxsize=2)
def _bench_image(size: int) -> Any:
    from PIL import Image

    top = max(size - 1, 1)
    pixels = [(x * 255 // top, y * 255 // top, 255 * ((x // 32 + y // 32) % 2))
              for y in range(size) for x in range(size)]
    img = Image.new("RGB", (size, size))
    img.putdata(pixels)
    return img


def with_image(message: dict[str, Any], url: str) -> dict[str, Any]:
    """``message`` with an ``image_url`` part of ``url`` after its text (OpenAI's content parts)."""
    parts = [{"type": "text", "text": message["content"]}, {"type": "image_url", "image_url": {"url": url}}]
    return {**message, "content": parts}


def add_images(reqs: list[SampleRequest], size: int, unique: bool, seed: int) -> list[SampleRequest]:
    """``reqs`` with one :func:`bench_image_url` of ``size`` in each one's last message (``unique``:
    the variant ``seed * 100_003 + index``, else the fixed picture); 0: ``reqs`` unchanged."""
    if size:
        for i, r in enumerate(reqs):
            url = bench_image_url(size, seed * 100_003 + i if unique else None)
            r.messages = [*r.messages[:-1], with_image(r.messages[-1], url)]
    return reqs


def build_payload(cfg: ClientConfig, req: SampleRequest) -> dict[str, Any]:
    """The JSON body of one streamed request (OpenAI chat/completions schema + the EOS strategy)."""
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": req.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
    }
    if cfg.endpoint.endswith("/chat/completions"):
        body["messages"] = req.messages
    else:
        body["prompt"] = "\n".join(m["content"] for m in req.messages)
    if cfg.stream_options:
        body["stream_options"] = {"include_usage": True}
    if req.fixed_output:
        if cfg.eos_strategy == "ignore_eos":
            body["ignore_eos"] = True
        elif cfg.eos_strategy == "min_tokens":
            body["min_tokens"] = req.max_tokens
        elif cfg.eos_strategy == "logit_bias" and cfg.eos_token_ids:
            body["logit_bias"] = {str(t): -100 for t in cfg.eos_token_ids}
    body.update(cfg.extra_body)
    return body


def _content_of(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""


#: how many times :func:`send_request` sends again a request the server never answered
UNANSWERED_RETRIES = 2


async def sse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """The lines of an SSE body, split on ``\\n`` only (a trailing ``\\r`` dropped), as the SSE
    spec splits them. httpx's ``aiter_lines`` splits as ``str.splitlines`` does, so a chunk whose
    raw UTF-8 text holds U+2028, U+0085 or a form feed (servers send JSON with ``ensure_ascii``
    off) came as two lines, neither of them JSON: a failed request."""
    pending = ""
    async for text in resp.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


async def send_request(
    client: httpx.AsyncClient, cfg: ClientConfig, req: SampleRequest, stamps: list[float] | None = None
) -> RequestResult:
    """Send one streamed request and time it. Never raises: failures are ``success=False`` results.
    ``stamps``, when given, gets the ``time.perf_counter()`` of each content chunk as it arrives
    (for a caller watching running streams, :func:`long_prompt_point`).

    A request the server never answered (the connection failed or was closed before a status line:
    a keep-alive connection the server had closed) is sent again, at most :data:`UNANSWERED_RETRIES`
    times, as the OpenAI SDKs do for connection errors (``max_retries`` 2); ``retries`` counts them and
    the times run from the first try."""
    res = RequestResult(local_prompt_len=req.prompt_len)
    body = build_payload(cfg, req)
    url = cfg.base_url.rstrip("/") + cfg.endpoint
    st = time.perf_counter()
    res.start_time = st
    while True:
        answered = await _stream_once(client, cfg, url, body, res, st, stamps)
        if answered or res.retries >= UNANSWERED_RETRIES:
            return res
        res.retries += 1
        res.error = ""


async def _stream_once(client: httpx.AsyncClient, cfg: ClientConfig, url: str, body: dict[str, Any],
                       res: RequestResult, st: float, stamps: list[float] | None) -> bool:
    """One try of :func:`send_request`, filling ``res``; False when the server sent no status line
    (``res.error`` says why), True otherwise (success or failure alike)."""
    last = st
    parts: list[str] = []
    answered = False
    try:
        async with client.stream("POST", url, json=body, timeout=cfg.timeout_s) as resp:
            answered = True
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                res.latency = time.perf_counter() - st
                return True
            async for line in sse_lines(resp):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk and not chunk.get("choices"):
                    res.error = f"stream error: {chunk['error']}"[:300]
                    break
                for choice in chunk.get("choices") or []:
                    text = _content_of(choice)
                    if text:
                        if stamps is not None:
                            stamps.append(now)
                        if res.num_content_chunks == 0:
                            res.ttft = now - st
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.num_content_chunks += 1
                        parts.append(text)
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.output_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        res.cached_tokens = int(details["cached_tokens"])
                timings = chunk.get("timings")
                if (
                    isinstance(timings, dict)
                    and timings.get("cache_n") is not None
                    and res.cached_tokens is None
                ):
                    res.cached_tokens = int(timings["cache_n"])
        res.latency = time.perf_counter() - st
        res.generated_text = "".join(parts)
        if not res.error:
            if res.num_content_chunks == 0:
                res.error = "no content in the stream"
            else:
                res.success = True
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, the run goes on
        res.latency = time.perf_counter() - st
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        unanswered = isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException)
        return answered or not unanswered  # a timeout is not sent again: the server may be slow
    return True


def _arrival_gaps(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gap (s) before each request: gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate;
    all 0 when rate is inf."""
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    gaps = [float(g) for g in rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)]
    return [0.0, *gaps[1:]] if gaps else []  # the first request goes at once, as in vLLM


async def run_load_point(
    cfg: ClientConfig,
    requests: Sequence[SampleRequest],
    max_concurrency: int | None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    seed: int = 0,
    show_progress: bool = True,
    desc: str = "",
) -> tuple[list[RequestResult], float]:
    """Run one load point; returns (results in request order, duration in seconds).

    Closed loop when ``request_rate`` is inf (``max_concurrency`` requests in flight); otherwise
    requests arrive at gamma-distributed gaps and ``max_concurrency`` (if set) caps those in flight.
    """
    limit = max_concurrency or max(len(requests), 1)
    sem = asyncio.Semaphore(limit)
    pbar = None
    if show_progress:
        from tqdm import tqdm

        pbar = tqdm(total=len(requests), desc=desc or "requests", leave=False, file=sys.stderr)
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(limits=limits, timeout=cfg.timeout_s) as client:

        async def one(req: SampleRequest) -> RequestResult:
            async with sem:
                r = await send_request(client, cfg, req)
            if pbar is not None:
                pbar.update(1)
            return r

        gaps = _arrival_gaps(len(requests), request_rate, burstiness, seed)
        start = time.perf_counter()
        tasks = []
        for req, gap in zip(requests, gaps):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()
    return results, duration


async def run_conversations(
    cfg: ClientConfig,
    conversations: Sequence[Conversation],
    max_concurrency: int | None,
    show_progress: bool = True,
    desc: str = "",
) -> tuple[list[RequestResult], float]:
    """Run multi-turn conversations, at most ``max_concurrency`` at once, each turn after the last.

    Each turn's request carries the system prompt, every earlier user message and the server's own
    earlier replies, then the new user message. A failed turn ends its conversation. Returns (the
    results of every request sent, turn order within each conversation; duration in seconds).
    """
    limit = max_concurrency or max(len(conversations), 1)
    sem = asyncio.Semaphore(limit)
    pbar = None
    if show_progress:
        from tqdm import tqdm

        total = sum(len(c.user_turns) for c in conversations)
        pbar = tqdm(total=total, desc=desc or "turns", leave=False, file=sys.stderr)
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(limits=limits, timeout=cfg.timeout_s) as client:

        async def one(conv: Conversation) -> list[RequestResult]:
            out: list[RequestResult] = []
            messages = [{"role": "system", "content": conv.system}]
            async with sem:
                for turn, text in enumerate(conv.user_turns, start=1):
                    messages.append({"role": "user", "content": text})
                    req = SampleRequest([dict(m) for m in messages], conv.max_tokens, None, conv.fixed_output)
                    r = await send_request(client, cfg, req)
                    r.turn = turn
                    out.append(r)
                    if pbar is not None:
                        pbar.update(1)
                    if not r.success:
                        break
                    messages.append({"role": "assistant", "content": r.generated_text})
            return out

        start = time.perf_counter()
        per_conv = await asyncio.gather(*(one(c) for c in conversations))
        duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()
    return [r for rs in per_conv for r in rs], duration


# --------------------------------------------------------------------------------------------------
# Long prompts


def gaps_overlapping(stamps: Sequence[float], start: float, end: float) -> list[float]:
    """The gaps (seconds) between consecutive ``stamps`` (ascending) that overlap ``[start, end]``:
    each ``(a, b)`` with ``a < end`` and ``b > start``, so a gap that a prefill stretched counts even
    when it began before the prompt was sent or ended after its first token."""
    return [b - a for a, b in itertools.pairwise(stamps) if a < end and b > start]


def gaps_before(stamps: Sequence[float], start: float) -> list[float]:
    """The gaps (seconds) between consecutive ``stamps`` that ended at or before ``start``."""
    return [b - a for a, b in itertools.pairwise(stamps) if b <= start]


def _ms(values: Sequence[float], q: float | None = None) -> float | None:
    if not values:
        return None
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    return float(np.max(arr)) if q is None else float(np.percentile(arr, q))


async def _wait_for(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.perf_counter() + timeout_s
    while not cond():
        if time.perf_counter() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def running_requests(client: httpx.AsyncClient, cfg: ClientConfig) -> int | None:
    """Requests the server is running now, or None where it does not say: llama-server's ``GET
    /slots`` (slots with ``is_processing``), else a Prometheus ``GET /metrics`` gauge named
    ``*:num_requests_running`` (vLLM's ``vllm:``, streamproxy's ``streamproxy:``), summed over labels."""
    root = cfg.base_url.rstrip("/").removesuffix("/v1")
    try:
        slots = await client.get(root + "/slots")
        if slots.status_code == 200 and isinstance(slots.json(), list):
            return sum(1 for slot in slots.json() if isinstance(slot, dict) and slot.get("is_processing"))
        metrics = await client.get(root + "/metrics")
    except (httpx.HTTPError, ValueError):
        return None
    if metrics.status_code != 200:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in metrics.text.splitlines()
              if line.split("{", 1)[0].split(" ", 1)[0].endswith(":num_requests_running")]
    return int(sum(values)) if values else None


async def wait_until_idle(client: httpx.AsyncClient, cfg: ClientConfig, timeout_s: float) -> bool:
    """Wait until :func:`running_requests` is 0 (True), or ``timeout_s`` seconds (False); True at once
    where the server does not say. Why: a server may go on generating for a cancelled stream
    (llama-server ran the cancelled 2048-token streams of one prompt length to their end, so the next
    length's prompt met eight of them), and the next measurement must start on an idle server."""
    deadline = time.perf_counter() + timeout_s
    while await running_requests(client, cfg):
        if time.perf_counter() > deadline:
            return False
        await asyncio.sleep(0.25)
    return True


_BESIDE_FIELDS = ("beside_ttft_ms", "beside_prefill_tok_s", "stream_itl_before_p99_ms",
                  "stream_itl_during_p50_ms", "stream_itl_during_p99_ms", "stream_itl_during_max_ms",
                  "stream_gaps_during")


async def long_prompt_point(
    cfg: ClientConfig,
    length: int,
    tokenizer: Any,
    seed: int,
    streams: int = 8,
    stream_input_len: int = 32,
    stream_output_len: int = 2048,
    warm_chunks: int = 4,
) -> dict[str, Any]:
    """Prefill speed and its cost to running streams at one prompt length.

    1. **Alone**: one request of ``length`` prompt tokens (``random_requests``; 4 output tokens),
       nothing else running: its TTFT and ``prompt tokens / TTFT`` (prefill tokens/s; the TTFT
       includes the request's own overhead and its first decode step).
    2. **Beside streams**: ``streams`` requests of ``stream_input_len`` in / ``stream_output_len``
       out start; once each has sent ``warm_chunks`` content chunks, another ``length``-token prompt
       (a fresh one: no prefix cache helps) is sent. Its TTFT, and the streams' inter-token gaps that
       overlap the window from its send to the first chunk every stream sends after its first token
       (:func:`gaps_overlapping`): p50, p99 and max, beside the p99 of their gaps before it was sent.
       The streams are then cancelled. ``streams_outlasted`` is False when a stream ended before the
       window closed (raise ``stream_output_len``). ``streams=0`` skips this part (its fields None):
       for a server that runs one request at a time, where the prompt would wait for the streams.

    Returns a dict of those fields (ms, tokens/s; None where nothing was measured) and ``errors``.
    """
    fixed = cfg.eos_strategy != "none"
    alone_req, beside_req = random_requests(2, length, 4, seed, tokenizer, fixed_output=fixed)
    stream_reqs = random_requests(streams, stream_input_len, stream_output_len, seed + 7, tokenizer, fixed)
    out: dict[str, Any] = {"prompt_len": length, "streams": streams, "errors": []}
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(limits=limits, timeout=cfg.timeout_s) as client:
        alone = await send_request(client, cfg, alone_req)
        tokens = alone.prompt_tokens or alone.local_prompt_len or length
        out.update(prompt_tokens=tokens, alone_ttft_ms=alone.ttft * 1000 if alone.success else None,
                   alone_prefill_tok_s=tokens / alone.ttft if alone.success and alone.ttft > 0 else None)
        if not alone.success:
            out["errors"].append(f"alone: {alone.error}")
        if streams == 0:
            return {**out, **dict.fromkeys(_BESIDE_FIELDS), "streams_outlasted": True}
        stamps: list[list[float]] = [[] for _ in stream_reqs]
        tasks = [asyncio.create_task(send_request(client, cfg, r, st)) for r, st in zip(stream_reqs, stamps)]
        warm = await _wait_for(lambda: all(len(st) >= warm_chunks for st in stamps), cfg.timeout_s)
        if not warm:
            out["errors"].append(f"the {streams} streams did not all start within {cfg.timeout_s:.0f} s")
        sent = time.perf_counter()
        beside = await send_request(client, cfg, beside_req)
        first = sent + beside.ttft if beside.success else time.perf_counter()
        counts = [len(st) for st in stamps]
        await _wait_for(lambda: all(len(st) > n or t.done() for st, n, t in zip(stamps, counts, tasks)),
                        cfg.timeout_s)
        closed = max([first] + [st[-1] for st in stamps if st])
        outlasted = not any(t.done() for t in tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not await wait_until_idle(client, cfg, cfg.timeout_s):
            out["errors"].append(f"the server still ran requests {cfg.timeout_s:.0f} s after the streams "
                                 "were cancelled")
    during = [g for st in stamps for g in gaps_overlapping(st, sent, closed)]
    before = [g for st in stamps for g in gaps_before(st, sent)]
    if not beside.success:
        out["errors"].append(f"beside streams: {beside.error}")
    out.update(
        beside_ttft_ms=beside.ttft * 1000 if beside.success else None,
        beside_prefill_tok_s=tokens / beside.ttft if beside.success and beside.ttft > 0 else None,
        stream_itl_before_p99_ms=_ms(before, 99),
        stream_itl_during_p50_ms=_ms(during, 50),
        stream_itl_during_p99_ms=_ms(during, 99),
        stream_itl_during_max_ms=_ms(during),
        stream_gaps_during=len(during),
        streams_outlasted=outlasted,
    )
    return out


def long_prompt_line(p: dict[str, Any]) -> str:
    """One human line per prompt length of :func:`long_prompt_point`."""

    def f(v: float | None, unit: str = "") -> str:
        return "-" if v is None else f"{v:,.0f}{unit}"

    beside = (
        f"  beside {p['streams']} streams: TTFT "
        f"{f(p['beside_ttft_ms'], ' ms')}; their gaps p50/p99/max {f(p['stream_itl_during_p50_ms'])}/"
        f"{f(p['stream_itl_during_p99_ms'])}/{f(p['stream_itl_during_max_ms'])} ms "
        f"(p99 before {f(p['stream_itl_before_p99_ms'])} ms)"
        if p["stream_gaps_during"] is not None else ""
    )
    return (
        f"prompt {p['prompt_tokens']:>6} tok  alone: TTFT {f(p['alone_ttft_ms'], ' ms')}, "
        f"{f(p['alone_prefill_tok_s'], ' tok/s')}" + beside
        + ("" if p["streams_outlasted"] else "  [a stream ended early]")
        + "".join(f"\n    error: {e}" for e in p["errors"])
    )


async def run_long_prompts(
    args: argparse.Namespace, cfg: ClientConfig, tokenizer: Any
) -> list[dict[str, Any]]:
    """:func:`long_prompt_point` at each ``--long-prompt-lens``, after one short warm-up request."""
    async with httpx.AsyncClient(timeout=cfg.timeout_s) as client:
        warm = random_requests(1, 16, 8, args.seed + 3, tokenizer, cfg.eos_strategy != "none")[0]
        await send_request(client, cfg, warm)
    points = []
    for i, length in enumerate(args.long_prompt_lens):
        point = await long_prompt_point(cfg, length, tokenizer, args.seed + 7919 * (i + 1),
                                        args.long_prompt_streams, args.random_input_len,
                                        args.long_prompt_stream_len)
        print(long_prompt_line(point), flush=True)
        points.append(point)
    return points


async def fetch_model_id(base_url: str) -> str:
    """The first model id of ``GET /v1/models``."""
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.get(base_url.rstrip("/") + "/v1/models")
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])


# --------------------------------------------------------------------------------------------------
# Reporting


def summary_line(m: dict[str, Any]) -> str:
    """One human line per load point."""
    load = f"c={m['max_concurrency']}" if math.isinf(m["request_rate"]) else f"rate={m['request_rate']}"
    line = (
        f"{load:>8}  ok={m['completed']:>4} fail={m['failed']:>3}  out tok/s={m['output_throughput']:8.1f}  "
        f"req/s={m['request_throughput']:6.2f}  TTFT "
        f"mean/p99={m['mean_ttft_ms']:7.1f}/{m['p99_ttft_ms']:7.1f} ms  "
        f"TPOT={m['mean_tpot_ms']:6.1f} ms  ITL p99={m['p99_itl_ms']:6.1f} ms  "
        f"E2E p90={m['p90_e2el_ms']:8.1f} ms  mean out "
        f"len={m['total_output_tokens'] / max(m['completed'], 1):.1f}"
    )
    if m.get("retried"):  # requests the server never answered, sent again (send_request)
        line += f"  retried={m['retried']}"
    if m.get("ttft_by_turn"):
        turns = " ".join(f"{t}:{v['mean_ttft_ms']:.0f}" for t, v in m["ttft_by_turn"].items())
        ratio = m.get("ttft_later_over_turn1")
        line += (
            f"\n          TTFT by turn (mean ms) {turns}  turns 2+/turn 1={ratio:.2f}"
            if ratio is not None
            else ""
        )
    if m.get("prefix_cache_hit_rate") is not None:
        line += f"\n          prefix cache hit rate {100 * m['prefix_cache_hit_rate']:.1f}%"
    return line


def plot_runs(summaries: Sequence[dict[str, Any]], out: Path) -> None:
    """PNG: CDFs of TTFT, ITL and E2E latency (largest load point of each summary) and output tok/s
    vs load for each summary (one line per server)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    multi = len(summaries) > 1
    for s in summaries:
        runs = s["runs"]
        if not runs:
            continue
        label = s.get("label", "")
        shown = [runs[-1]] if multi else runs
        for run in shown:
            tag = label if multi else _load_tag(run)
            if multi:
                tag = f"{label} ({_load_tag(run)})"
            ok = [e == "" for e in run["errors"]]
            ttft = sorted(t * 1000 for t, good in zip(run["ttfts"], ok) if good)
            e2e = sorted(t * 1000 for t, good in zip(run["latencies"], ok) if good)
            itl = sorted(g * 1000 for gaps, good in zip(run["itls"], ok) if good for g in gaps)
            for ax, vals in ((axes[0][0], ttft), (axes[0][1], itl), (axes[1][0], e2e)):
                if vals:
                    frac = np.arange(0, len(vals) + 1) / len(vals)  # empirical CDF from 0 to 1
                    ax.step([vals[0], *vals], frac, where="post", label=tag)
        xs = [r["max_concurrency"] if math.isinf(r["request_rate"]) else r["request_rate"] for r in runs]
        axes[1][1].plot(xs, [r["output_throughput"] for r in runs], marker="o", label=label or "server")
    for ax, title in (
        (axes[0][0], "TTFT CDF (ms)"),
        (axes[0][1], "ITL CDF (ms)"),
        (axes[1][0], "E2E latency CDF (ms)"),
    ):
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if ax is not axes[0][1] else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    rate_mode = all(not math.isinf(r["request_rate"]) for s in summaries for r in s["runs"])
    axes[1][1].set_title("output throughput vs " + ("request rate" if rate_mode else "concurrency"))
    axes[1][1].set_xlabel("request rate (req/s)" if rate_mode else "concurrent streams")
    axes[1][1].set_ylabel("output tokens/s")
    if not rate_mode:
        axes[1][1].set_xscale("log", base=2)
        ticks = sorted({r["max_concurrency"] for s in summaries for r in s["runs"] if r["max_concurrency"]})
        axes[1][1].set_xticks(ticks, [str(t) for t in ticks])
    axes[1][1].grid(alpha=0.3)
    axes[1][1].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _load_tag(run: dict[str, Any]) -> str:
    return (
        f"c={run['max_concurrency']}" if math.isinf(run["request_rate"]) else f"{run['request_rate']} req/s"
    )


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    raise TypeError(type(o).__name__)


def _dump(obj: Any, path: Path) -> None:
    # inf request rates are written as the string "inf" (JSON has no infinity), as vLLM does.
    def fix(v: Any) -> Any:
        if isinstance(v, float) and math.isinf(v):
            return "inf"
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v

    path.write_text(json.dumps(fix(obj), default=_json_default, indent=1))


def load_summary(path: Path) -> dict[str, Any]:
    """Read a ``<label>.json`` summary back (``"inf"`` -> float inf)."""
    s = json.loads(path.read_text())
    for r in s["runs"]:
        r["request_rate"] = float(r["request_rate"])
    return s


# --------------------------------------------------------------------------------------------------
# CLI


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    p.add_argument(
        "--endpoint", default="/v1/chat/completions", choices=["/v1/chat/completions", "/v1/completions"]
    )
    p.add_argument("--model", default=None, help="model id to send (default: first of GET /v1/models)")
    p.add_argument("--label", default="server", help="name of this run in file names and tables")
    p.add_argument("--dataset", default="random", choices=["random", "conversational", "multiturn"])
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of conversational requests")
    p.add_argument("--multiturn-turns", type=int, default=6, help="turns per multiturn conversation")
    p.add_argument("--multiturn-system-len", type=int, default=500, help="words of the shared system prompt")
    p.add_argument("--multiturn-unique-system", action="store_true",
                   help="a system prompt of its own per conversation (default: one shared by all), so "
                        "turn 1 computes it on any server and turns 2+ show what caching saves")
    p.add_argument("--multiturn-user-len", type=int, default=40, help="words per user message")
    p.add_argument("--image-size", type=int, default=0,
                   help="each request carries one generated N x N PNG (random and conversational datasets; "
                        "0: none)")
    p.add_argument("--image-unique", action="store_true",
                   help="with --image-size: a different image per request (its number stamped in)")
    p.add_argument("--reuse-prompts", action="store_true",
                   help="send the same prompts at every load point and in the warm-up (default: fresh ones)")
    p.add_argument(
        "--tokenizer", default=None, help="LOCAL tokenizer folder for prompt lengths (never a hub id)"
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=0,
        help="requests per load point (0: 4 x concurrency, >= 8); multiturn: conversations "
        "(0: 2 x concurrency)",
    )
    p.add_argument(
        "--max-concurrency", type=_ints, default=[1, 4, 8, 16, 32], help="e.g. 1,4,8,16,32 (a sweep)"
    )
    p.add_argument(
        "--request-rate",
        type=_floats,
        default=[math.inf],
        help="req/s, e.g. 2,4 (Poisson); inf = closed loop",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1.0 = Poisson")
    p.add_argument(
        "--eos-strategy", default="ignore_eos", choices=["ignore_eos", "min_tokens", "logit_bias", "none"]
    )
    p.add_argument(
        "--eos-token-ids", type=_ints, default=[], help="ids biased to -100 with --eos-strategy logit_bias"
    )
    p.add_argument(
        "--no-stream-options", action="store_true", help="do not send stream_options.include_usage"
    )
    p.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    p.add_argument(
        "--num-warmups", type=int, default=2, help="requests sent (and not measured) before each run"
    )
    p.add_argument("--long-prompt-lens", type=_ints, default=[],
                   help="after the sweep, prefill at these prompt lengths (tokens), e.g. 1024,8192,32000: "
                        "alone and beside --long-prompt-streams running streams (long_prompt_point)")
    p.add_argument("--long-prompt-streams", type=int, default=8,
                   help="streams running (--random-input-len in) while a long prompt prefills")
    p.add_argument("--long-prompt-stream-len", type=int, default=2048,
                   help="max_tokens of those streams (they are cancelled once measured)")
    p.add_argument("--percentiles", type=_floats, default=list(DEFAULT_PERCENTILES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--result-dir", default="bench/out", help="where JSON and PNG are written")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def _load_points(args: argparse.Namespace) -> list[tuple[int | None, float]]:
    rates, concs = args.request_rate, args.max_concurrency
    if len(rates) > 1 and len(concs) > 1:
        raise SystemExit("sweep either --max-concurrency or --request-rate, not both")
    if len(rates) > 1 or not math.isinf(rates[0]):
        cap = concs[0] if len(concs) == 1 else None
        return [(cap, r) for r in rates]
    return [(c, math.inf) for c in concs]


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run every load point of ``args``; write the JSON files and plot; return the summary dict."""
    model = args.model or await fetch_model_id(args.base_url)
    tokenizer = load_tokenizer(args.tokenizer)
    count_tokens = None
    if tokenizer is not None:

        def count_tokens(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False))

    cfg = ClientConfig(
        base_url=args.base_url,
        model=model,
        endpoint=args.endpoint,
        eos_strategy=args.eos_strategy,
        eos_token_ids=tuple(args.eos_token_ids),
        stream_options=not args.no_stream_options,
        extra_body=json.loads(args.extra_body),
        timeout_s=args.timeout,
    )
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for point, (max_conc, rate) in enumerate(_load_points(args)):
        # fresh prompts per point (and for its warm-up) unless --reuse-prompts
        seed = args.seed if args.reuse_prompts else args.seed + 1009 * (point + 1)
        warm_seed = seed if args.reuse_prompts else seed + 1
        tag = f"c{max_conc}" if math.isinf(rate) else f"r{rate:g}"
        if args.dataset == "multiturn":
            n = args.num_prompts or 2 * (max_conc or 4)
            convs = multiturn_conversations(
                n, args.multiturn_turns, args.multiturn_system_len, args.multiturn_user_len,
                args.random_output_len, seed, fixed_output=args.eos_strategy != "none",
                shared_system=not args.multiturn_unique_system,
            )
            if args.num_warmups:
                warm_convs = multiturn_conversations(
                    args.num_warmups,
                    1,
                    args.multiturn_system_len,
                    args.multiturn_user_len,
                    16,
                    warm_seed,
                    False,
                )
                await run_conversations(cfg, warm_convs, max_conc, show_progress=False)
            results, duration = await run_conversations(
                cfg, convs, max_conc, not args.no_progress, f"{args.label} {tag}"
            )
        else:
            n = args.num_prompts or max(8, 4 * (max_conc or 4))
            reqs = _dataset(args, n, seed, tokenizer)
            if args.num_warmups:
                source = (
                    reqs if args.reuse_prompts else _dataset(args, args.num_warmups, warm_seed, tokenizer)
                )
                warm = [
                    SampleRequest(r.messages, min(r.max_tokens, 16), r.prompt_len)
                    for r in source[: args.num_warmups]
                ]
                await run_load_point(cfg, warm, max_conc, show_progress=False)
            results, duration = await run_load_point(
                cfg,
                reqs,
                max_conc,
                rate,
                args.burstiness,
                args.seed,
                not args.no_progress,
                f"{args.label} {tag}",
            )
        m = calculate_metrics(results, duration, args.percentiles, count_tokens)
        m.update(turn_metrics(results, args.percentiles))
        m["prefix_cache_hit_rate"] = prefix_cache_hit_rate(results)
        m["cached_tokens"] = [r.cached_tokens for r in results]
        m["turns"] = [r.turn for r in results]
        m.update(
            {
                "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
                "label": args.label,
                "backend": "openai-chat" if args.endpoint.endswith("chat/completions") else "openai",
                "base_url": args.base_url,
                "endpoint": args.endpoint,
                "model_id": model,
                "tokenizer_id": args.tokenizer,
                "dataset_name": args.dataset,
                "image_size": args.image_size or None,
                "image_unique": args.image_unique if args.image_size else None,
                "random_input_len": args.random_input_len if args.dataset == "random" else None,
                "random_output_len": args.random_output_len if args.dataset == "random" else None,
                "eos_strategy": args.eos_strategy,
                "num_prompts": n,
                "reuse_prompts": args.reuse_prompts,
                "prompt_seed": seed,
                "request_rate": rate,
                "burstiness": args.burstiness,
                "max_concurrency": max_conc,
                "output_tokens_source": _tokens_source(results, tokenizer is not None),
            }
        )
        _dump(m, out_dir / f"{args.label}-{tag}.json")
        print(summary_line(m), flush=True)
        for err in sorted({e for e in m["errors"] if e})[:3]:
            print(f"    error: {err}", flush=True)
        runs.append(m)
    summary: dict[str, Any] = {"label": args.label, "model_id": model, "runs": runs}
    if args.long_prompt_lens:
        summary["long_prompts"] = await run_long_prompts(args, cfg, tokenizer)
    _dump(summary, out_dir / f"{args.label}.json")
    if not args.no_plot and runs:
        plot_runs([summary], out_dir / f"{args.label}.png")
    return summary


def _dataset(args: argparse.Namespace, n: int, seed: int, tokenizer: Any) -> list[SampleRequest]:
    image_size = getattr(args, "image_size", 0)
    if args.dataset == "random":
        reqs = random_requests(
            n,
            args.random_input_len,
            args.random_output_len,
            seed,
            tokenizer,
            fixed_output=args.eos_strategy != "none",
            no_added_tokens=image_size > 0,
        )
    else:
        reqs = conversational_requests(n, args.max_tokens, tokenizer)
    return add_images(reqs, image_size, getattr(args, "image_unique", False), seed)


def _tokens_source(results: Sequence[RequestResult], has_tokenizer: bool) -> str:
    ok = [r for r in results if r.success]
    if ok and all(r.output_tokens is not None for r in ok):
        return "usage"
    return "tokenizer" if has_tokenizer else "chunks"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        pp = argparse.ArgumentParser(description="overlay summaries <label>.json of several servers")
        pp.add_argument("summaries", nargs="+")
        pp.add_argument("--out", required=True)
        a = pp.parse_args(argv[1:])
        plot_runs([load_summary(Path(s)) for s in a.summaries], Path(a.out))
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.image_size and (args.dataset == "multiturn" or not args.endpoint.endswith("/chat/completions")):
        parser.error("--image-size needs chat requests of the random or conversational dataset")
    summary = asyncio.run(run_benchmark(args))
    long_ok = all(not p["errors"] for p in summary.get("long_prompts", []))
    return 0 if all(r["completed"] > 0 for r in summary["runs"]) and long_ok else 1


if __name__ == "__main__":
    sys.exit(main())
