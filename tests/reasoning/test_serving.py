"""Thinking models served end to end (in-process app, real engine, a tiny random Qwen3-style model):
the reasoning split off the answer on Chat Completions and the Responses API, exactly.

Invariants (issue 27 item 2), over many seeds with ``logit_bias`` placing ``</think>`` mid-output:
reasoning + ``</think>`` + content == the text of the same request with the parser off; stream ==
non-stream for both fields and for ``usage`` (``reasoning_tokens`` included); a ``max_tokens`` cut
inside the thinking gives reasoning only and ``finish_reason: "length"``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from api.conftest import sse_json
from api.real_app import real_app

from proxy.settings import Settings
from reasoning.fixtures import make_qwen3_style_tokenizer, write_qwen3_style_model

NAME = "tiny-thinker"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_style_model(tmp_path_factory.mktemp("thinker") / "qwen3-style", think_tokens="added")


@pytest.fixture(scope="module")
def close_id() -> int:
    return int(make_qwen3_style_tokenizer("added").convert_tokens_to_ids("</think>"))


async def with_app(model_dir: Path, fn, reasoning_parser: str = ""):
    settings = Settings(model=str(model_dir), served_model_name=NAME, max_model_len=512, num_kv_blocks=64,
                        num_threads=1, device="cpu", dtype="float32", reasoning_parser=reasoning_parser,
                        self_check=False, engine_process=False)
    async with real_app(settings) as (client, _):
        return await fn(client)


def chat(seed: int, close_id: int, **kw: Any) -> dict[str, Any]:
    return {"model": NAME, "messages": [{"role": "user", "content": "Think, then answer."}], "max_tokens": 24,
            "temperature": 1.0, "seed": seed, "ignore_eos": True, "logit_bias": {str(close_id): 6}, **kw}


def streamed(chunks: list[dict[str, Any]]) -> tuple[str, str, str | None, dict[str, Any]]:
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"])
    assert reasoning == "".join(c["choices"][0]["delta"].get("reasoning", "") for c in chunks if c["choices"])
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks
              if c["choices"] and c["choices"][0]["finish_reason"]]
    return reasoning, content, finish[0], chunks[-1]["usage"]


SEEDS = range(12)


def test_split_is_exact_over_seeds(model_dir: Path, close_id: int) -> None:
    async def run_on(client: httpx.AsyncClient) -> list[tuple[Any, ...]]:
        out = []
        for seed in SEEDS:
            whole = (await client.post("/v1/chat/completions", json=chat(seed, close_id))).json()
            raw = (await client.post("/v1/chat/completions", json=chat(
                seed, close_id, stream=True, stream_options={"include_usage": True}))).content
            out.append((whole, streamed(sse_json(raw))))
        return out

    async def run_off(client: httpx.AsyncClient) -> list[str]:
        bodies = [(await client.post("/v1/chat/completions", json=chat(s, close_id))).json() for s in SEEDS]
        return [b["choices"][0]["message"]["content"] for b in bodies]

    on = asyncio.run(with_app(model_dir, run_on))
    off = asyncio.run(with_app(model_dir, run_off, reasoning_parser="none"))
    split_mid = 0
    for (whole, (s_reasoning, s_content, s_finish, s_usage)), text in zip(on, off):
        msg = whole["choices"][0]["message"]
        reasoning, content = msg.get("reasoning_content", ""), msg["content"] or ""
        assert msg.get("reasoning", "") == reasoning
        finish = whole["choices"][0]["finish_reason"]
        assert (s_reasoning, s_content, s_finish) == (reasoning, content, finish)
        # the second request of a seed hits the prefix cache: only cached_tokens may differ
        assert {**s_usage, "prompt_tokens_details": None} == {**whole["usage"], "prompt_tokens_details": None}
        details = whole["usage"]["completion_tokens_details"]["reasoning_tokens"]
        if "</think>" in text:
            assert reasoning + "</think>" + content == text
            assert 0 < details <= whole["usage"]["completion_tokens"]
            split_mid += bool(reasoning and content)
        else:  # max_tokens cut inside the thinking: reasoning only, finish "length"
            assert (reasoning, content, whole["choices"][0]["finish_reason"]) == (text, "", "length")
            assert details == whole["usage"]["completion_tokens"] == 24
        assert "</think>" not in reasoning + s_reasoning
    assert split_mid >= 3  # the seeds really put the tag mid-output


def test_thinking_off_and_controls(model_dir: Path, close_id: int) -> None:
    async def run(client: httpx.AsyncClient) -> list[Any]:
        no_thinking = (await client.post("/v1/chat/completions", json=chat(
            1, close_id, logit_bias={}, chat_template_kwargs={"enable_thinking": False}))).json()
        effort_none = (await client.post("/v1/chat/completions", json=chat(
            1, close_id, logit_bias={}, reasoning_effort="none"))).json()
        bad = await client.post("/v1/chat/completions", json=chat(1, close_id, reasoning_effort="maximal"))
        bad_kwargs = await client.post("/v1/chat/completions",
                                       json=chat(1, close_id, chat_template_kwargs=[1]))
        return [no_thinking, effort_none, bad.status_code, bad.json(), bad_kwargs.json()]

    no_thinking, effort_none, status, bad, bad_kwargs = asyncio.run(with_app(model_dir, run))
    for body in (no_thinking, effort_none):
        msg = body["choices"][0]["message"]
        assert "reasoning_content" not in msg and "reasoning" not in msg and msg["content"]
        assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert no_thinking["choices"][0]["message"] == effort_none["choices"][0]["message"]
    assert status == 400 and bad["error"]["param"] == "reasoning_effort"
    assert bad_kwargs["error"]["param"] == "chat_template_kwargs"


def responses_events(raw: bytes) -> list[dict[str, Any]]:
    events = []
    for block in raw.decode("utf-8").split("\n\n"):
        if not block or block.startswith(":"):
            continue
        head, data = block.split("\n")
        obj = json.loads(data[len("data: "):])
        assert head == f"event: {obj['type']}"
        events.append(obj)
    return events


def test_responses_api_reasoning_item(model_dir: Path, close_id: int) -> None:
    seed = next(s for s in SEEDS if s >= 0)
    body = {"model": NAME, "input": "Think, then answer.", "max_output_tokens": 24, "temperature": 1.0,
            "seed": seed, "ignore_eos": True, "logit_bias": {str(close_id): 6}}

    async def run(client: httpx.AsyncClient) -> list[Any]:
        whole = (await client.post("/v1/responses", json=body)).json()
        raw = (await client.post("/v1/responses", json={**body, "stream": True})).content
        as_chat = (await client.post("/v1/chat/completions", json=chat(seed, close_id))).json()
        return [whole, responses_events(raw), as_chat]

    whole, events, as_chat = asyncio.run(with_app(model_dir, run))
    msg = as_chat["choices"][0]["message"]
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == (["reasoning", "message"] if msg["content"] else ["reasoning"] if msg.get(
        "reasoning_content") else ["message"])
    if msg.get("reasoning_content"):
        assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": msg["reasoning_content"]}]
        assert whole["output"][0]["summary"] == [{"type": "summary_text", "text": msg["reasoning_content"]}]
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == as_chat["usage"][
        "completion_tokens_details"]["reasoning_tokens"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    summary = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta")
    assert deltas == summary == (msg.get("reasoning_content") or "")
    final = events[-1]["response"]
    assert final["output"] == [{**item, "id": f["id"]} for item, f in zip(whole["output"], final["output"])]
    assert final["usage"]["output_tokens_details"] == whole["usage"]["output_tokens_details"]


SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


def test_structured_output_applies_after_the_thinking(model_dir: Path, close_id: int) -> None:
    """response_format on a thinking model: the thinking is what the unconstrained request thinks (same
    seed, same tokens), the answer after it validates; the OpenAI SDK's parse() shape reads it."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}

    async def run(client: httpx.AsyncClient) -> list[Any]:
        out = []
        for seed in range(6):
            free = (await client.post("/v1/chat/completions",
                                      json=chat(seed, close_id, max_tokens=40))).json()
            constrained = (await client.post("/v1/chat/completions", json=chat(
                seed, close_id, max_tokens=40, ignore_eos=False, response_format=fmt))).json()
            out.append((free, constrained))
        return out

    checked = 0
    for free, constrained in asyncio.run(with_app(model_dir, run)):
        f, c = free["choices"][0]["message"], constrained["choices"][0]["message"]
        if not f.get("reasoning_content") or constrained["choices"][0]["finish_reason"] != "stop":
            continue  # the thinking did not end within max_tokens for this seed
        assert c["reasoning_content"] == f["reasoning_content"]
        assert json.loads(c["content"]) in ({"answer": "yes"}, {"answer": "no"})
        checked += 1
    assert checked >= 2
