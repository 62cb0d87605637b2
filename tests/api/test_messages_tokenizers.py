"""Stream == non-stream of the Messages API on every tokenizer of the zoo (gpt-2, llama-bpe, llama-spm,
phi-3, qwen2; ``tests/testdata.py``): a scripted reply of thinking (with multibyte characters), text and
a tool call, tokenized by each, gives the same blocks streamed and whole: thinking and text exactly,
the tool input as the JSON its ``partial_json`` fragments join to."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from testdata import ZOO_NAMES, zoo_path
from transformers import AutoTokenizer

from proxy.api.app import create_app
from proxy.engine.client import AsyncEngineClient, ModelInfo
from proxy.settings import Settings
from proxy.tokenizer import Tokenizer

from .fakes import CHATML, FakeEngine
from .messages_sse import MODEL, THINK_CALL, TOOL, body, events, fold, same_message

REPLY = THINK_CALL.replace("weather.", "weather, café ñ 日本語.")


@functools.cache
def zoo_tokenizer(name: str) -> Tokenizer:
    """The zoo tokenizer with a ChatML template (a missing zoo fails: ``make setup`` fetches it)."""
    try:
        folder = zoo_path(name)
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
    hf = AutoTokenizer.from_pretrained(str(folder))
    hf.chat_template = CHATML
    return Tokenizer(hf)


@contextlib.asynccontextmanager
async def serve_with(tok: Tokenizer, engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    """The app over ``engine`` and ``tok`` (hermes tool calls, qwen3 thinking), in-process."""
    engine.eos_token_ids = tok.eos_token_ids
    client = AsyncEngineClient(engine, tok, ModelInfo(MODEL, 4096, len(tok.hf_tokenizer)))
    settings = Settings(served_model_name=MODEL, tool_call_parser="hermes", reasoning_parser="qwen3")
    app = create_app(settings, lambda _: client)
    async with app.router.lifespan_context(app):
        for _ in range(500):
            if app.state.server.status != "loading":
                break
            await asyncio.sleep(0.01)
        assert app.state.server.status == "ready", app.state.server.load_error
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            yield c


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_stream_equals_non_stream_on_every_zoo_tokenizer(name: str) -> None:
    tok = zoo_tokenizer(name)
    ids = tok.encode(REPLY) + [min(tok.eos_token_ids)]

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        async with serve_with(tok, FakeEngine(reply_ids=ids)) as c:
            b = body("Weather in Oslo?", tools=[TOOL])
            full = await c.post("/v1/messages", json=b)
            streamed = await c.post("/v1/messages", json={**b, "stream": True})
            assert full.status_code == streamed.status_code == 200, (full.text, streamed.text)
            return full.json(), fold(events(streamed.content))

    msg, folded = asyncio.run(main())
    assert [b["type"] for b in msg["content"]] == ["thinking", "text", "tool_use"]
    assert msg["content"][0]["thinking"] == "Hmm, 你好 🤗 weather, café ñ 日本語."
    assert msg["content"][1]["text"] == "Sure." and msg["content"][2]["input"] == {"city": "Oslo"}
    assert msg["stop_reason"] == "tool_use" and same_message(msg, folded)
