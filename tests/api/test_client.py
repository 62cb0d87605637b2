"""EngineClient over the scripted engine core: the Protocols hold, Generation yields coalesced
deltas, aclose aborts every choice, errors surface once, generate refuses before any output."""

from __future__ import annotations

import asyncio
import gc

import pytest

from proxy.engine.client import EngineClient, EngineCoreClient
from proxy.errors import ContextLengthExceededError, EngineDeadError, EngineError, RateLimitError
from proxy.sampling import SamplingParams

from .conftest import REPLY, reply_ids
from .fakes import FakeEngine, fake_client, make_tokenizer

GREEDY = SamplingParams(max_tokens=100, temperature=0.0)


def started(engine: FakeEngine, **kw) -> EngineClient:
    client = fake_client(engine, **kw)
    client.start()
    return client


def test_the_real_client_and_the_fake_core_implement_the_protocols():
    engine = FakeEngine()
    assert isinstance(engine, EngineCoreClient)
    assert isinstance(fake_client(engine), EngineClient)


def test_generation_yields_every_choice_until_finished():
    async def main():
        engine = FakeEngine(reply_ids=reply_ids(make_tokenizer()))
        client = started(engine)
        generation = client.generate([1, 2, 3], GREEDY, n=2, request_id="g")
        texts, finishes, token_ids = ["", ""], [None, None], [[], []]
        async for deltas in generation:
            assert len({d.index for d in deltas}) == len(deltas)  # at most one delta per choice
            for d in deltas:
                texts[d.index] += d.text
                token_ids[d.index] += d.token_ids
                finishes[d.index] = d.finish_reason or finishes[d.index]
        await generation.aclose()
        return engine, client, generation, texts, finishes, token_ids

    engine, client, generation, texts, finishes, token_ids = asyncio.run(main())
    ids = reply_ids(make_tokenizer())
    assert texts == [REPLY, REPLY] and finishes == ["stop", "stop"]
    assert token_ids == [ids, ids]  # the EOS token is accounted for, its text is not shown
    assert generation.usage.prompt_tokens == 3 and generation.usage.completion_tokens == 2 * len(ids)
    assert [r for r, _, _ in engine.submitted] == ["g-0", "g-1"] and engine.aborted == []
    assert client.stats().num_tracked_outputs == 0


def test_aclose_aborts_every_running_choice_once():
    async def main():
        engine = FakeEngine(reply_ids=[5, 6, 7], step_s=0.01)  # never reaches EOS
        client = started(engine)
        generation = client.generate([1], SamplingParams(max_tokens=1000, ignore_eos=True), n=3)
        first = await generation.__anext__()
        await generation.aclose()
        await generation.aclose()  # idempotent
        with pytest.raises(StopAsyncIteration):
            await generation.__anext__()
        return engine, client, first

    engine, client, first = asyncio.run(main())
    assert (
        first and sorted(engine.aborted) == sorted(r for r, _, _ in engine.submitted) and not engine.running
    )
    assert len(engine.aborted) == 3 and client.stats().num_tracked_outputs == 0


def test_an_unclosed_generation_aborts_when_collected():
    async def main():
        engine = FakeEngine(reply_ids=[5, 6, 7], step_s=0.01)
        client = started(engine)
        generation = client.generate([1], SamplingParams(max_tokens=1000, ignore_eos=True))
        await asyncio.sleep(0.05)
        del generation
        gc.collect()
        return engine

    engine = asyncio.run(main())
    assert len(engine.aborted) == 1 and not engine.running


def test_engine_error_is_raised_once_then_iteration_ends():
    async def main():
        engine = FakeEngine(reply_ids=[5, 6, 7], fail_after=2)
        generation = started(engine).generate([1], SamplingParams(max_tokens=10, ignore_eos=True))
        seen = []
        with pytest.raises(EngineError) as info:
            async for deltas in generation:
                seen += deltas
        with pytest.raises(StopAsyncIteration):
            await generation.__anext__()
        return seen, info.value

    seen, error = asyncio.run(main())
    assert error.message == "injected failure" and error.code == "engine_error" and error.status == 500
    assert seen  # the text before the failure was delivered


def test_generate_refuses_before_anything_runs():
    async def main():
        engine = FakeEngine(max_waiting=1)
        client = started(engine, max_model_len=16)
        with pytest.raises(ContextLengthExceededError):
            client.generate(list(range(10)), SamplingParams(max_tokens=7))
        with pytest.raises(RateLimitError):
            client.generate([1], SamplingParams(max_tokens=2), n=2)  # the second choice does not fit
        refused = list(engine.aborted)
        engine.is_healthy = False
        with pytest.raises(EngineDeadError):
            client.generate([1], SamplingParams(max_tokens=2))
        return client, refused, engine

    client, refused, engine = asyncio.run(main())
    assert refused == [engine.submitted[0][0]]  # the admitted first choice was withdrawn
    from prometheus_client.parser import text_string_to_metric_families

    rejected = [s.value for f in text_string_to_metric_families(client.metrics.render().decode())
                for s in f.samples if s.name == "streamproxy:request_rejected_total"]
    assert rejected == [1.0]
