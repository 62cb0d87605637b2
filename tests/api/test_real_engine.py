"""The API over the real engine (EngineCore + AsyncEngine + Tokenizer) with a tiny random Llama, in-process.

Fast (no default model): stream == non-stream at T0, n > 1 with seeds, the stop-prefix invariant with
the engine freed, and an engine fault after the stream started (C19): error event, [DONE], the
engine keeps serving.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from proxy.settings import Settings

from .conftest import sse_events, sse_json
from .fakes import make_hf_tokenizer, make_tiny_model
from .real_app import real_app

NAME = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    make_tiny_model(folder)
    return folder


def body(**kw):
    return {"model": NAME, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, **kw}


@pytest.fixture(params=[False, True], ids=["engine-thread", "engine-process"])
def engine_process(request: pytest.FixtureRequest) -> bool:
    """Both engine modes (``--no-engine-process`` / ``--engine-process``), as uvicorn's tests run both
    HTTP implementations."""
    return bool(request.param)


async def with_app(model_dir: Path, fn, engine_process: bool = False):
    settings = Settings(
        model=str(model_dir),
        served_model_name=NAME,
        max_model_len=256,
        num_kv_blocks=64,
        block_size=16,
        num_threads=1,
        device="cpu",
        dtype="float32",
        engine_process=engine_process,
    )
    async with real_app(settings) as (client, state):
        return await fn(client, state)


def counts(usage: dict) -> dict:
    """``usage`` without ``prompt_tokens_details``: what two runs of one prompt must agree on (a
    repeated prompt is served from the prefix cache, so its ``cached_tokens`` differ)."""
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


async def wait_idle(client: httpx.AsyncClient) -> dict:
    for _ in range(200):
        h = (await client.get("/health")).json()
        if h["num_running"] == 0 and h["num_free_blocks"] == h["num_total_blocks"]:
            return h
        await asyncio.sleep(0.01)
    raise AssertionError(h)


def test_real_engine_end_to_end(model_dir: Path, engine_process: bool):
    async def scenario(client: httpx.AsyncClient, state):
        out = {}
        plain, streamed = await asyncio.gather(
            client.post("/v1/chat/completions", json=body()),
            client.post(
                "/v1/chat/completions", json=body(stream=True, stream_options={"include_usage": True})
            ),
        )
        out["plain"], out["stream"] = plain.json(), sse_json(streamed.content)
        n2 = body(n=2, temperature=1.0, seed=11, max_tokens=6)
        out["n2_plain"] = (await client.post("/v1/chat/completions", json=n2)).json()
        out["n2_stream"] = sse_json(
            (await client.post("/v1/chat/completions", json={**n2, "stream": True})).content
        )
        raw = out["plain"]["choices"][0]["message"]["content"]
        stop = raw[len(raw) // 2: len(raw) // 2 + 2]
        out["stop"] = stop
        out["stopped"] = (await client.post("/v1/chat/completions", json=body(stop=[stop]))).json()
        out["idle"] = await wait_idle(client)
        if engine_process:  # the fault hook is a callable run in the forward pass: in-process only
            out["after"] = (await client.post("/v1/chat/completions", json=body(max_tokens=3))).json()
            out["health"] = await client.get("/health")
            out["metrics"] = (await client.get("/metrics")).text
            return out

        calls = {"n": 0}

        def fault() -> None:
            calls["n"] += 1
            if calls["n"] > 4:
                raise RuntimeError("injected fault")

        state.client.fault_injector = fault
        out["faulted"] = (await client.post("/v1/chat/completions", json=body(stream=True))).content
        state.client.fault_injector = None
        out["after"] = (await client.post("/v1/chat/completions", json=body(max_tokens=3))).json()
        out["health"] = await client.get("/health")
        out["metrics"] = (await client.get("/metrics")).text
        return out

    out = asyncio.run(with_app(model_dir, scenario, engine_process))
    plain, chunks = out["plain"], out["stream"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    assert plain["usage"]["completion_tokens"] == 12 and plain["choices"][0]["finish_reason"] == "length"
    assert counts(chunks[-1]["usage"]) == counts(plain["usage"])  # cached_tokens depends on the arrival order
    for i in (0, 1):
        mine = "".join(c["choices"][0]["delta"].get("content", "") for c in out["n2_stream"]
                       if c["choices"] and c["choices"][0]["index"] == i)
        assert mine == out["n2_plain"]["choices"][i]["message"]["content"]
    raw, stop = plain["choices"][0]["message"]["content"], out["stop"]
    assert out["stopped"]["choices"][0]["message"]["content"] == raw[: raw.find(stop)]
    assert out["stopped"]["choices"][0]["finish_reason"] == "stop"
    assert out["idle"]["num_running"] == 0
    if not engine_process:
        events = sse_events(out["faulted"])
        assert events[-1] == b"[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "server_error" and "injected fault" in err["message"]
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
    assert out["after"]["usage"]["completion_tokens"] == 3
    assert out["health"].status_code == 200
    # engine counters read at scrape time through EngineStats: the same prompt repeated hits the prefix cache
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for f in text_string_to_metric_families(out["metrics"]) for s in f.samples}
    assert values["streamproxy:prefix_cache_hits_total"] > 0
    assert values["streamproxy:prefix_cache_queries_total"] > values["streamproxy:prefix_cache_hits_total"]


def test_context_is_lowered_to_what_the_kv_pool_holds(model_dir: Path):
    """A pool smaller than max_model_len must not cut requests short with "length": the served
    context shrinks to the pool (4 blocks x 16 = 64 tokens) and longer requests get a 400."""
    from proxy.engine.factory import build_engine_client
    from proxy.protocol import resolve_max_tokens

    settings = Settings(model=str(model_dir), served_model_name=NAME, max_model_len=256, num_kv_blocks=4,
                        block_size=16, num_threads=1, device="cpu", dtype="float32")
    client = build_engine_client(settings)
    assert client.model.max_model_len == 64
    assert resolve_max_tokens(None, 10, client.model.max_model_len) == 54


def test_end_of_turn_token_stops_a_model_whose_config_names_only_endoftext(
    tmp_path: Path, engine_process: bool
):
    """One EOS rule (``find_eos_token_ids``): config and tokenizer say ``<|endoftext|>``, the chat
    template ends turns with ``<|im_end|>``; the engine must stop at either."""
    from proxy.engine.factory import build_engine_client

    folder = make_tiny_model(tmp_path / "tiny-eot", eos_token="<|endoftext|>")
    config = json.loads((folder / "config.json").read_text())
    hf = make_hf_tokenizer()
    im_end, endoftext = hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")
    assert config["eos_token_id"] == endoftext
    settings = Settings(model=str(folder), served_model_name=NAME, max_model_len=256, num_kv_blocks=64,
                        block_size=16, num_threads=1, device="cpu", dtype="float32")
    client = build_engine_client(settings)
    assert client.tokenizer.eos_token_ids == frozenset({im_end, endoftext})
    assert client.core.core.eos_token_ids == client.tokenizer.eos_token_ids  # what the engine stops on

    async def scenario(http: httpx.AsyncClient, state):
        forced = {"logit_bias": {str(im_end): 100}, "max_tokens": 5, "ignore_eos": False}
        return ((await http.post("/v1/chat/completions", json=body(**forced))).json(),
                (await http.post("/v1/chat/completions", json=body(**forced, min_tokens=2))).json())

    plain, with_min = asyncio.run(with_app(folder, scenario, engine_process))
    assert plain["choices"][0]["finish_reason"] == "stop" and plain["choices"][0]["message"]["content"] == ""
    assert plain["usage"]["completion_tokens"] == 1  # the <|im_end|> token itself
    # min_tokens=2: two other tokens first (the sampler masks EOS), then <|im_end|> ends it as the third
    assert with_min["choices"][0]["finish_reason"] == "stop" and with_min["usage"]["completion_tokens"] == 3


@pytest.fixture(params=[("thread", "compiled"), ("thread", "python"), ("process", "compiled")],
                ids=lambda p: f"engine-{p[0]}-{p[1]}")
def cache_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[bool, type]:
    """(engine mode, hot path): the usage chunk is framed by either hot-path twin, and the count
    crosses the engine-process pipe. Returns ``(engine_process, ChunkFramer class in use)``."""
    from proxy import hotpath
    from proxy.hotpath import python

    mode, impl = request.param
    if impl == "python":
        monkeypatch.setattr(hotpath, "ChunkFramer", python.ChunkFramer)
        return mode == "process", python.ChunkFramer
    if not hotpath.IS_COMPILED:
        pytest.skip("the compiled hot path is not loaded (test_hotpath_selector fails when CI requires it)")
    from proxy.hotpath import compiled

    return mode == "process", compiled.ChunkFramer


def test_cached_prompt_tokens_are_reported_in_usage(model_dir: Path, cache_mode: tuple[bool, type]):
    """Issue 11: ``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field) = prompt tokens served
    from the prefix cache: 0 on a first request; the same prompt again hits whole 16-token blocks,
    never the last prompt token; stream (``include_usage`` chunk) and non-stream agree, on chat and
    legacy completions."""
    from proxy.protocol import CHAT

    engine_process, framer_class = cache_mode
    assert type(CHAT.framer("x", 0, NAME, True)) is framer_class  # the twin under test frames the stream
    messages = [{"role": "user", "content": "Tell me a story about " + "a red fox and a blue bird, " * 6}]
    prompt = "Once upon a time, " * 12
    usage_chunk = {"stream": True, "stream_options": {"include_usage": True}}

    async def scenario(client: httpx.AsyncClient, state):
        chat = [(await client.post("/v1/chat/completions", json=body(messages=messages))).json()
                for _ in range(2)]
        chat.append(sse_json((await client.post("/v1/chat/completions",
                                                json=body(messages=messages, **usage_chunk))).content))
        plain = {"model": NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        completion = [sse_json((await client.post("/v1/completions", json={**plain, **usage_chunk})).content),
                      (await client.post("/v1/completions", json=plain)).json(),
                      sse_json((await client.post("/v1/completions", json={**plain, **usage_chunk})).content)]
        return chat, completion

    chat, completion = asyncio.run(with_app(model_dir, scenario, engine_process))
    chat_first, completion_first = chat[0]["usage"], completion[0][-1]["usage"]  # non-stream, stream
    for first, second, streamed in ((chat_first, *chat[1:]), (completion_first, *completion[1:])):
        num_prompt = first["prompt_tokens"]
        assert num_prompt > 32
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached <= num_prompt - 1 and cached % 16 == 0
        assert cached == (num_prompt - 1) // 16 * 16  # every full block before the last prompt token
        assert counts(second["usage"]) == counts(first)
        assert streamed[-1]["choices"] == [] and streamed[-1]["usage"] == second["usage"]
    assert chat[1]["choices"][0]["message"]["content"] == chat[0]["choices"][0]["message"]["content"]
    assert completion[1]["choices"][0]["text"] == "".join(c["choices"][0]["text"] for c in completion[0]
                                                          if c["choices"])
    joined = "".join(c["choices"][0]["delta"].get("content", "") for c in chat[2] if c["choices"])
    assert joined == chat[0]["choices"][0]["message"]["content"]
