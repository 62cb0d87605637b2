"""AsyncEngine (the in-process engine core client) with a tiny model: hand-off per step, abort, 429,
fault injection, death, idle wait."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from proxy.engine.async_engine import AsyncEngine
from proxy.engine.core import EngineCore
from proxy.engine.request import RequestOutput
from proxy.errors import EngineDeadError, RateLimitError
from proxy.sampling import SamplingParams
from proxy.settings import Settings

EOS = 2
SETTINGS = Settings(num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)
LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_pair):
    return tiny_pair[2]


def prompt(i: int) -> list[int]:
    return [(7 * i + k) % 90 + 3 for k in range(5 + i)]


class Router:
    """The ``on_outputs`` handler given to ``AsyncEngine.start``: checks the thread, records the size
    of each step's hand-off and routes each output to its request's collector."""

    def __init__(self) -> None:
        self.collectors: dict[str, Collector] = {}
        self.batches: list[int] = []

    def __call__(self, outputs: list[RequestOutput]) -> None:
        self.batches.append(len(outputs))
        for out in outputs:
            self.collectors[out.request_id](out)


ROUTERS: dict[AsyncEngine, Router] = {}


def router_of(engine: AsyncEngine) -> Router:
    return ROUTERS.setdefault(engine, Router())


def start(engine: AsyncEngine) -> None:
    engine.start(router_of(engine))


def submit(engine: AsyncEngine, request_id: str, prompt_ids: list[int], params: SamplingParams,
           collector: Collector) -> None:
    router_of(engine).collectors[request_id] = collector
    engine.add_request(request_id, prompt_ids, params)


class Collector:
    """Collects one request's outputs, checks the thread, resolves a future when finished."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.outputs: list[RequestOutput] = []
        self.done = loop.create_future()
        self.loop_thread = threading.get_ident()

    def __call__(self, out: RequestOutput) -> None:
        assert threading.get_ident() == self.loop_thread
        self.outputs.append(out)
        if out.finished:
            self.done.set_result(out)

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.new_token_ids]


def test_submit_runs_requests_with_one_hand_off_per_step(model) -> None:
    async def main() -> None:
        engine = AsyncEngine(EngineCore(model, SETTINGS, [EOS], 256), max_waiting=8)
        batches = router_of(engine).batches
        start(engine)
        loop = asyncio.get_running_loop()
        collectors = {str(i): Collector(loop) for i in range(3)}
        for rid, c in collectors.items():
            submit(engine, rid, prompt(int(rid)), SHORT, c)
        finals = await asyncio.wait_for(asyncio.gather(*(c.done for c in collectors.values())), 60)
        assert [f.finish_reason for f in finals] == ["length"] * 3
        assert all(len(c.tokens) == 6 for c in collectors.values())
        assert max(batches) == 3  # all three requests' outputs came in one hand-off
        assert sum(batches) == 18
        assert engine.kv_cache_usage == 0.0 and engine.num_running == 0 and engine.num_waiting == 0
        assert engine.is_healthy
        engine.shutdown()
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            submit(engine, "late", prompt(1), SHORT, collectors["0"])

    asyncio.run(main())


def test_abort_stops_outputs_and_frees_blocks(model) -> None:
    async def main() -> None:
        core = EngineCore(model, SETTINGS, [EOS], 256)
        engine = AsyncEngine(core, max_waiting=8)
        start(engine)
        loop = asyncio.get_running_loop()
        first = loop.create_future()
        seen: list[RequestOutput] = []

        def on_output(out: RequestOutput) -> None:
            seen.append(out)
            if not first.done():
                first.set_result(None)

        submit(engine, "a", prompt(3), LONG, on_output)  # type: ignore[arg-type]
        await asyncio.wait_for(first, 30)
        engine.abort_requests(["a"])
        engine.abort_requests(["a"])  # idempotent
        engine.abort_requests(["never-submitted"])
        n = len(seen)
        for _ in range(100):
            await asyncio.sleep(0.02)
            if core.num_free_blocks == core.num_total_blocks and not core.has_unfinished():
                break
        assert core.num_free_blocks == core.num_total_blocks
        assert len(seen) == n and not any(o.finished for o in seen)
        engine.shutdown()

    asyncio.run(main())


def test_waiting_queue_full_raises_rate_limit(model) -> None:
    async def main() -> None:
        # one place in the batch + two waiting: a burst of three is admitted, the fourth is refused
        settings = Settings(num_kv_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=1)
        engine = AsyncEngine(EngineCore(model, settings, [EOS], 256), max_waiting=2)
        loop = asyncio.get_running_loop()
        collectors = [Collector(loop) for _ in range(4)]
        for i in range(3):  # not started yet: all stay waiting
            submit(engine, str(i), prompt(i), SHORT, collectors[i])
        assert engine.num_waiting == 3
        with pytest.raises(RateLimitError):
            submit(engine, "3", prompt(3), SHORT, collectors[3])
        start(engine)
        await asyncio.wait_for(asyncio.gather(*(c.done for c in collectors[:3])), 60)
        assert engine.num_waiting == 0
        submit(engine, "3", prompt(3), SHORT, collectors[3])
        assert (await asyncio.wait_for(collectors[3].done, 60)).finish_reason == "length"
        engine.shutdown()

    asyncio.run(main())


def test_fault_injection_fails_that_step_and_engine_keeps_serving(model) -> None:
    async def main() -> None:
        core = EngineCore(model, SETTINGS, [EOS], 256)
        engine = AsyncEngine(core, max_waiting=8)
        state = {"armed": True}

        def injector() -> None:
            if state["armed"]:
                state["armed"] = False
                raise torch.cuda.OutOfMemoryError("simulated OOM")

        engine.fault_injector = injector
        assert core.fault_injector is injector
        start(engine)
        loop = asyncio.get_running_loop()
        bad = Collector(loop)
        submit(engine, "bad", prompt(1), SHORT, bad)
        final = await asyncio.wait_for(bad.done, 30)
        assert final.finish_reason == "error" and "simulated OOM" in (final.error or "")
        assert engine.is_healthy and core.num_free_blocks == core.num_total_blocks
        good = Collector(loop)
        submit(engine, "good", prompt(2), SHORT, good)
        assert (await asyncio.wait_for(good.done, 30)).finish_reason == "length"
        assert len(good.tokens) == 6
        engine.shutdown()

    asyncio.run(main())


def test_engine_death_fails_requests_and_reports_unhealthy(model) -> None:
    async def main() -> None:
        core = EngineCore(model, SETTINGS, [EOS], 256)
        engine = AsyncEngine(core, max_waiting=8)

        def broken_schedule():
            raise RuntimeError("scheduler bug")

        core.scheduler.schedule = broken_schedule  # type: ignore[method-assign]
        start(engine)
        c = Collector(asyncio.get_running_loop())
        submit(engine, "a", prompt(1), SHORT, c)
        final = await asyncio.wait_for(c.done, 30)
        assert final.finish_reason == "error" and "scheduler bug" in (final.error or "")
        assert not engine.is_healthy
        with pytest.raises(EngineDeadError):
            submit(engine, "b", prompt(1), SHORT, c)
        engine.shutdown()

    asyncio.run(main())


def test_idle_engine_blocks_instead_of_spinning(model) -> None:
    class CountingEvent(threading.Event):
        waits = 0

        def wait(self, timeout=None):  # type: ignore[override]
            CountingEvent.waits += 1
            return super().wait(timeout)

    async def main() -> None:
        engine = AsyncEngine(EngineCore(model, SETTINGS, [EOS], 256), max_waiting=8)
        engine._wake = CountingEvent()
        start(engine)
        c = Collector(asyncio.get_running_loop())
        submit(engine, "a", prompt(1), SHORT, c)
        await asyncio.wait_for(c.done, 30)
        previous = -1
        for _ in range(25):  # let the thread reach its idle wait (a spinning loop never settles)
            if CountingEvent.waits == previous:
                break
            previous = CountingEvent.waits
            await asyncio.sleep(0.2)
        before = CountingEvent.waits
        steps = engine.core.num_steps
        await asyncio.sleep(0.5)
        assert CountingEvent.waits - before == 0  # still inside one blocking wait
        assert engine.core.num_steps == steps
        c2 = Collector(asyncio.get_running_loop())
        submit(engine, "b", prompt(2), SHORT, c2)  # wakes it
        assert (await asyncio.wait_for(c2.done, 30)).finish_reason == "length"
        engine.shutdown()

    asyncio.run(main())


def test_shutdown_fails_live_requests(model) -> None:
    async def main() -> None:
        engine = AsyncEngine(EngineCore(model, SETTINGS, [EOS], 256), max_waiting=8)
        start(engine)
        c = Collector(asyncio.get_running_loop())
        submit(engine, "a", prompt(1), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True), c)
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        final = await asyncio.wait_for(c.done, 10)
        assert final.finish_reason == "error" and final.error == "the engine shut down"
        assert engine.core.num_free_blocks == engine.core.num_total_blocks

    asyncio.run(main())
