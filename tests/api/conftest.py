"""Fixtures of the API tests: the app over a FakeEngine and a tiny tokenizer, in-process (httpx)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.api.app import create_app
from proxy.engine.client import EngineClient
from proxy.settings import Settings

from .fakes import FakeEngine, fake_client, grammar_compiler, make_hf_tokenizer, make_tokenizer

MODEL = "test-model"
MAX_MODEL_LEN = 128
REPLY = "Hello world! alpha beta 你好 🤗 END more"


@dataclass
class Served:
    client: httpx.AsyncClient
    app: Any
    engine: FakeEngine
    tokenizer: Any


def reply_ids(tokenizer: Any, text: str = REPLY) -> list[int]:
    """Token ids of ``text`` followed by the EOS token."""
    return list(tokenizer.encode(text)) + [make_hf_tokenizer().convert_tokens_to_ids("<|im_end|>")]


@contextlib.asynccontextmanager
async def serve(engine: FakeEngine | None = None, *, max_model_len: int = MAX_MODEL_LEN,
                with_grammar: bool = False, **settings: Any) -> AsyncIterator[Served]:
    """Run the app's lifespan around an httpx client on ASGITransport; waits until it is ready."""
    tokenizer = make_tokenizer()
    if engine is None:
        engine = FakeEngine(reply_ids=reply_ids(tokenizer))
    settings.setdefault("served_model_name", MODEL)
    cfg = Settings(**settings)
    if with_grammar:
        grammar_compiler()  # built before start-up: the readiness wait below is short

    def factory(_: Settings) -> EngineClient:
        return fake_client(engine, MODEL, max_model_len, vocab_size=len(make_hf_tokenizer()),
                           with_grammar=with_grammar)

    app = create_app(cfg, factory)
    async with app.router.lifespan_context(app):
        state = app.state.server
        for _ in range(500):
            if state.status != "loading":
                break
            await asyncio.sleep(0.01)
        assert state.status == "ready", state.load_error
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as client:
            yield Served(client, app, engine, tokenizer)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def sse_events(raw: bytes) -> list[bytes]:
    """Split an SSE body into event payloads (after ``data: ``); asserts the exact framing."""
    assert raw.endswith(b"\n\n"), raw[-50:]
    events = raw[:-2].split(b"\n\n")
    out = []
    for e in events:
        if e.startswith(b":"):
            continue
        assert e.startswith(b"data: ") and b"\n" not in e, e
        out.append(e[len(b"data: "):])
    return out


def sse_json(raw: bytes) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body; asserts it ends with exactly one ``[DONE]``."""
    events = sse_events(raw)
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    chunks = []
    for e in events[:-1]:
        obj = json.loads(e.decode("utf-8"))
        # canonical compact JSON, as the framer promises
        assert json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() == e
        chunks.append(obj)
    return chunks


def chat_body(content: str = "Hi", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}
