"""The thinking budget served end to end on a tiny random Qwen3-style thinking model (``</think>`` one
token): Chat Completions' ``thinking_token_budget`` (vLLM's extra) in-process, and Anthropic's
``thinking.budget_tokens`` through the ``anthropic`` SDK against a real server on 127.0.0.1.

Greedy output with a budget N has exactly N thinking tokens, then ``</think>`` (one token), then the
model's own continuation; the N thinking tokens are the unbudgeted run's first N; stream == non-stream;
a budgeted request beside an unbudgeted one leaves the other's text as it is alone.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from api.conftest import sse_json
from api.real_app import real_app

from proxy.settings import Settings
from reasoning.fixtures import write_qwen3_style_model

NAME = "tiny-thinker"
CLOSE = "</think>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_style_model(tmp_path_factory.mktemp("budget") / "qwen3-style", think_tokens="added",
                                   positions=2048)


async def with_app(model_dir: Path, fn, reasoning_parser: str = ""):
    settings = Settings(model=str(model_dir), served_model_name=NAME, max_model_len=512, num_kv_blocks=96,
                        num_threads=1, device="cpu", dtype="float32", reasoning_parser=reasoning_parser,
                        self_check=False, engine_process=False)
    async with real_app(settings) as (client, _):
        return await fn(client)


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"model": NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 30,
            "temperature": 0, "ignore_eos": True, "logprobs": True, **kw}


def tokens(body: dict[str, Any]) -> list[str]:
    """The generated tokens' texts (one logprobs entry a token)."""
    return [e["token"] for e in body["choices"][0]["logprobs"]["content"]]


def streamed(raw: bytes) -> tuple[str, str, dict[str, Any]]:
    chunks = sse_json(raw)
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"])
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return reasoning, content, chunks[-1]["usage"]


PROMPTS = ("Think, then answer.", "What is 2 + 2?", "Hello!")
BUDGETS = (0, 1, 5, 12)


def test_chat_budget_is_exact_stream_equals_non_stream(model_dir: Path) -> None:
    async def run(client: httpx.AsyncClient) -> list[Any]:
        out = []
        for prompt in PROMPTS:
            free = (await client.post("/v1/chat/completions", json=chat(prompt))).json()
            for n in BUDGETS:
                capped = (await client.post("/v1/chat/completions",
                                            json=chat(prompt, thinking_token_budget=n))).json()
                raw = (await client.post("/v1/chat/completions", json=chat(
                    prompt, thinking_token_budget=n, stream=True,
                    stream_options={"include_usage": True}))).content
                cut = (await client.post("/v1/chat/completions",
                                         json=chat(prompt, max_tokens=max(n, 1)))).json()
                out.append((n, free, capped, streamed(raw), cut))
        return out

    for n, free, capped, (s_reasoning, s_content, s_usage), cut in asyncio.run(with_app(model_dir, run)):
        free_tokens, capped_tokens = tokens(free), tokens(capped)
        assert CLOSE not in free_tokens[:n]  # the model does not close it by itself this early
        assert capped_tokens[:n] == free_tokens[:n] and capped_tokens[n] == CLOSE
        assert len(capped_tokens) == 30 and capped["choices"][0]["finish_reason"] == "length"
        msg = capped["choices"][0]["message"]
        # the thinking is the unbudgeted output cut at n tokens, exactly; the answer follows the tag
        thinking = cut["choices"][0]["message"]["reasoning_content"] if n else ""
        assert msg.get("reasoning_content", "") == thinking
        assert msg["content"]
        assert capped["usage"]["completion_tokens_details"]["reasoning_tokens"] == n + 1  # the tag's too
        assert (s_reasoning, s_content) == (msg.get("reasoning_content", ""), msg["content"])
        assert s_usage["completion_tokens_details"] == capped["usage"]["completion_tokens_details"]


def test_batch_invariance_and_refusals(model_dir: Path) -> None:
    async def run(client: httpx.AsyncClient) -> list[Any]:
        alone = (await client.post("/v1/chat/completions", json=chat(PROMPTS[1], max_tokens=40))).json()
        beside = await asyncio.gather(
            client.post("/v1/chat/completions",
                        json=chat(PROMPTS[0], thinking_token_budget=3, max_tokens=40)),
            client.post("/v1/chat/completions", json=chat(PROMPTS[1], max_tokens=40)))
        bad = await client.post("/v1/chat/completions", json=chat(PROMPTS[0], thinking_token_budget=-2))
        no_cap = (await client.post("/v1/chat/completions",
                                    json=chat(PROMPTS[0], thinking_token_budget=-1))).json()
        free = (await client.post("/v1/chat/completions", json=chat(PROMPTS[0]))).json()
        return [alone, [r.json() for r in beside], bad.status_code, bad.json(), no_cap, free]

    alone, (capped, other), status, bad, no_cap, free = asyncio.run(with_app(model_dir, run))
    assert other["choices"][0]["message"] == alone["choices"][0]["message"]
    assert tokens(capped)[3] == CLOSE
    assert status == 400 and bad["error"]["param"] == "thinking_token_budget"
    assert no_cap["choices"][0]["message"] == free["choices"][0]["message"]  # vLLM's -1: no cap

    async def refused(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/chat/completions", json=chat(PROMPTS[0], thinking_token_budget=4))

    response = asyncio.run(with_app(model_dir, refused, reasoning_parser="none"))
    assert response.status_code == 400 and response.json()["error"]["param"] == "thinking_token_budget"
    assert "no reasoning parser" in response.json()["error"]["message"]


def test_a_marker_of_several_tokens_is_forced_whole(tmp_path: Path) -> None:
    """``</think>`` not in the vocabulary (several plain tokens): all of them are forced, one a step;
    the thinking is the unbudgeted output cut at N tokens and the parser splits at the whole marker."""
    from reasoning.fixtures import make_qwen3_style_tokenizer

    plain = write_qwen3_style_model(tmp_path / "plain", think_tokens="plain")
    width = len(make_qwen3_style_tokenizer("plain").encode(CLOSE, add_special_tokens=False))
    assert width > 1

    async def run(client: httpx.AsyncClient) -> list[Any]:
        out = []
        for n in (0, 4, 9):
            capped = (await client.post("/v1/chat/completions", json=chat(PROMPTS[0], thinking_token_budget=n,
                                                                           logprobs=False))).json()
            cut = (await client.post("/v1/chat/completions", json=chat(PROMPTS[0], max_tokens=max(n, 1),
                                                                        logprobs=False))).json()
            out.append((n, capped, cut))
        return out

    for n, capped, cut in asyncio.run(with_app(plain, run)):
        msg = capped["choices"][0]["message"]
        thinking = cut["choices"][0]["message"]["reasoning_content"] if n else ""
        assert msg.get("reasoning_content", "") == thinking
        assert msg["content"] and CLOSE not in msg["content"]
        assert capped["usage"]["completion_tokens_details"]["reasoning_tokens"] == n + width


MESSAGES_BUDGET = 1024  # Anthropic's smallest budget_tokens


def test_anthropic_sdk_budget_tokens_on_a_real_server(model_dir: Path, tmp_path: Path) -> None:
    """``thinking: {type: "enabled", budget_tokens: 1024}`` through the ``anthropic`` SDK (non-stream and
    the ``.stream()`` helper) against ``python -m proxy serve`` on 127.0.0.1: the thinking block is the
    unbudgeted output cut at 1024 tokens (Chat Completions with ``max_tokens`` 1024), then the answer;
    the SDK's final streamed message has the non-stream one's content. Without a reasoning parser the same
    body is a 400 naming ``thinking.budget_tokens``."""
    import anthropic
    from production.helpers import start_server

    args = ["--model", str(model_dir), "--served-model-name", NAME, "--max-model-len", "2048",
            "--num-kv-blocks", "512", "--num-threads", "1", "--device", "cpu", "--dtype", "float32",
            "--no-self-check", "--no-engine-process"]
    ask: dict[str, Any] = {"model": NAME, "max_tokens": MESSAGES_BUDGET + 12,
                           "messages": [{"role": "user", "content": PROMPTS[1]}],
                           "thinking": {"type": "enabled", "budget_tokens": MESSAGES_BUDGET},
                           "extra_body": {"ignore_eos": True, "temperature": 0}}  # SDK 2.17: no temperature
    server = start_server(tmp_path, args)
    try:
        with anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=300) as sdk:
            msg = sdk.messages.create(**ask)
            with sdk.messages.stream(**ask) as stream:
                final = stream.get_final_message()
        cut = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=300, json=chat(
            PROMPTS[1], max_tokens=MESSAGES_BUDGET, chat_template_kwargs={"enable_thinking": True})).json()
    finally:
        server.stop()
    assert [b.type for b in msg.content] == ["thinking", "text"] and msg.stop_reason == "max_tokens"
    assert CLOSE not in "".join(tokens(cut))  # the model would think on: the budget closed it
    assert msg.content[0].thinking == cut["choices"][0]["message"]["reasoning_content"]
    assert msg.usage.output_tokens == MESSAGES_BUDGET + 12 and msg.content[1].text
    def blocks(m: Any) -> list[tuple[str, str]]:
        return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in m.content]

    assert blocks(final) == blocks(msg) and final.stop_reason == msg.stop_reason  # the stream folds back
    assert final.content[0].signature == msg.content[0].signature
    assert final.usage.output_tokens == msg.usage.output_tokens  # (the prompt hit the prefix cache)
    server = start_server(tmp_path, [*args, "--reasoning-parser", "none"], name="no-parser")
    try:
        sdk = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
        with sdk, pytest.raises(anthropic.BadRequestError) as refused:
            sdk.messages.create(**ask)
    finally:
        server.stop()
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "'thinking.budget_tokens' cannot be enforced" in refused.value.message
