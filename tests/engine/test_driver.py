"""CoreDriver (the one loop around EngineCore.step), the admission rule, and the process messages."""

from __future__ import annotations

import pickle
import types
from collections.abc import Iterable, Sequence

import pytest
import torch

from proxy.engine import admission
from proxy.engine.core_proc.messages import (
    AbortRequests,
    AddRequest,
    Compiled,
    CompileFailure,
    CompileGrammar,
    CoreStats,
    EngineCommand,
    LoadFailed,
    Progress,
    ReadyInfo,
    ReserveCores,
    StepResult,
    Stop,
)
from proxy.engine.driver import CoreDriver
from proxy.engine.request import RequestOutput, TokenLogprob
from proxy.errors import RateLimitError
from proxy.sampling import SamplingParams, StructuredOutputParams
from proxy.threads import run_in_own_thread


class ScriptedCore:
    """The ``EngineCore`` calls the driver makes, recorded; each step finishes every live request."""

    def __init__(self) -> None:
        self.live: list[str] = []
        self.calls: list[str] = []

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    images: object = None) -> None:
        self.calls.append(f"add {request_id}")
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        self.live.append(request_id)

    def abort_request(self, request_id: str) -> None:
        self.calls.append(f"abort {request_id}")
        if request_id in self.live:
            self.live.remove(request_id)

    def step(self) -> list[RequestOutput]:
        self.calls.append("step")
        done = [RequestOutput(rid, [7], None, True, "length", 1, 1) for rid in self.live]
        self.live = []
        return done


def scripted(turns: list[list[EngineCommand]]):  # type: ignore[no-untyped-def]
    blocks: list[bool] = []

    def receive(block: bool) -> Iterable[EngineCommand]:
        blocks.append(block)
        return turns.pop(0)

    return receive, blocks


def test_driver_applies_steps_and_publishes_each_turn_until_stop() -> None:
    core = ScriptedCore()
    driver = CoreDriver(core)
    published: list[list[str]] = []
    receive, blocks = scripted([
        [AddRequest("a", [1, 2], SamplingParams()), AddRequest("b", [], SamplingParams())],
        [AddRequest("c", [3], SamplingParams()), AbortRequests(["c"])],
        [AddRequest("d", [], SamplingParams()), Stop(), AddRequest("e", [4], SamplingParams())],
    ])
    def publish(outputs: list[RequestOutput]) -> None:
        published.append([f"{o.request_id}:{o.finish_reason}" for o in outputs])

    left = driver.run(receive, publish)
    # turn 1: "b" is refused (its own error output), "a" steps; turn 2: nothing left to step
    assert published == [["b:error", "a:length"], []]
    assert core.calls == ["add a", "add b", "step", "add c", "abort c", "add d"]  # "e" after Stop is left
    assert blocks == [True, True, True]  # idle at the start of every turn: each turn finished its work
    assert [(o.request_id, o.error, o.num_prompt_tokens) for o in left] == [("d", "empty prompt", 0)]
    assert driver.num_adds_taken == 4


class CountingCore(ScriptedCore):
    """A core on the CPU that records torch's intra-op thread count at each step."""

    runner = types.SimpleNamespace(device=torch.device("cpu"))

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def step(self) -> list[RequestOutput]:
        self.seen.append(torch.get_num_threads())
        return super().step()


def run_built_at_3_threads(turns: list[list[EngineCommand]], adaptive: bool = True,
                           other_thread_sets: int | None = None) -> CoreDriver:
    """A driver built on a thread with 3 intra-op threads, run on another thread through ``turns``
    (after another thread set ``other_thread_sets``, when given); torch's process-wide count restored."""
    def build() -> CoreDriver:
        torch.set_num_threads(3)
        return CoreDriver(CountingCore(), adaptive_threads=adaptive)

    before = torch.get_num_threads()
    try:
        driver = run_in_own_thread(build)
        assert driver.num_threads == 3
        if other_thread_sets is not None:
            run_in_own_thread(torch.set_num_threads, other_thread_sets)
        receive, _ = scripted(turns)
        run_in_own_thread(driver.run, receive, lambda outputs: None)
    finally:  # the process-wide value later threads start from
        torch.set_num_threads(before)
    return driver


def test_driver_steps_with_the_thread_count_of_the_thread_that_built_it() -> None:
    """torch gives a new thread its intra-op count from the last ``set_num_threads`` of any thread
    (the embedding worker sets 1 for itself): the engine thread must not inherit that."""
    driver = run_built_at_3_threads([[AddRequest("a", [1], SamplingParams())], [Stop()]], other_thread_sets=1)
    assert driver.core.seen == [3]
    assert CoreDriver(ScriptedCore()).num_threads is None  # no runner (not on a device): untouched


@pytest.mark.parametrize("adaptive", [True, False])
def test_reserve_cores_steps_with_fewer_threads_until_given_back(adaptive: bool) -> None:
    """``ReserveCores`` (a several-model server's load beside this engine): the full count less the
    cores, at least one, until ``ReserveCores(0)``; under the adaptive rule and without it."""
    def add(rid: str) -> AddRequest:
        return AddRequest(rid, [1], SamplingParams())

    driver = run_built_at_3_threads([[add("a")], [ReserveCores(1), add("b")], [ReserveCores(5), add("c")],
                                     [ReserveCores(0), add("d")], [Stop()]], adaptive)
    assert driver.core.seen == [3, 2, 1, 3]
    assert driver.num_reserves_taken == 3  # the sender's acknowledgement (CoreStats.num_reserves_taken)


def test_driver_hands_grammar_compiles_to_its_compile_thread() -> None:
    got: list[CompileGrammar] = []
    driver = CoreDriver(ScriptedCore(), got.append)
    command = CompileGrammar(3, StructuredOutputParams("choice", '["yes"]'), "guided_choice")
    assert driver.apply([command], []) is False
    assert got == [command]


def test_failed_output_is_a_final_error_with_no_tokens() -> None:
    out = RequestOutput.failed("r", "the engine shut down", num_prompt_tokens=5)
    assert (out.new_token_ids, out.new_logprobs, out.finished, out.finish_reason) == ([], None, True, "error")
    assert (out.num_prompt_tokens, out.num_output_tokens, out.error) == (5, 0, "the engine shut down")


@pytest.mark.parametrize(("running", "waiting", "admitted"), [
    (0, 3, True),  # 4 free places: 3 waiting start next step, nothing really waits
    (0, 5, True),  # 4 free places, 1 beyond them < max_waiting 2
    (0, 6, False),  # 2 beyond the free places: the queue is full
    (4, 1, True),
    (4, 2, False),
    (6, 2, False),  # more running than max_num_seqs (not possible, but no negative free places)
])
def test_admission_counts_the_running_batch_free_places_out_of_waiting(
    running: int, waiting: int, admitted: bool
) -> None:
    if admitted:
        admission.check_admission(running, waiting, max_num_seqs=4, max_waiting=2)
    else:
        with pytest.raises(RateLimitError, match=r"too many requests waiting \(2\)"):
            admission.check_admission(running, waiting, max_num_seqs=4, max_waiting=2)


def test_waiting_counts_adds_in_flight_once() -> None:
    assert admission.num_waiting(core_waiting=2, num_adds_sent=5, num_adds_taken=3) == 4
    assert admission.num_waiting(core_waiting=2, num_adds_sent=3, num_adds_taken=3) == 2
    assert admission.num_waiting(core_waiting=2, num_adds_sent=0, num_adds_taken=3) == 2  # a restarted child


def test_stats_carry_every_counter_to_engine_stats() -> None:
    stats = CoreStats(3, 1, 0.25, 30, 40, 2, 512, 256, 9)
    engine = stats.engine_stats(num_waiting=4, num_engine_restarts=1)
    assert (engine.num_running, engine.num_waiting, engine.kv_cache_usage, engine.num_free_blocks,
            engine.num_total_blocks) == (3, 4, 0.25, 30, 40)
    assert (engine.num_preemptions, engine.prefix_cache_queries, engine.prefix_cache_hits,
            engine.num_engine_restarts) == (2, 512, 256, 1)


def test_every_message_kind_round_trips_through_pickle() -> None:
    output = RequestOutput("r", [5], [TokenLogprob(5, -0.5, [(5, -0.5)])], False, None, 3, 1,
                           arrival_time=1.0, first_token_time=2.0, num_cached_tokens=2)
    messages = [
        AddRequest("r", [1, 2], SamplingParams(max_tokens=4, stop=["x"])),
        AbortRequests(["r", "s"]),
        CompileGrammar(7, StructuredOutputParams("regex", "a+"), "guided_regex"),
        Stop(),
        ReserveCores(1),
        Progress("loading"),
        LoadFailed("OSError: gone"),
        ReadyInfo("/m", "m", 128, (2,), 100, "float32", "none", 1.5, ""),
        StepResult([output], CoreStats(1, 0, 0.5, 1, 2, 0, 3, 2, 1)),
        Compiled(7, CompileFailure("invalid", "bad regex", "guided_regex")),
        Compiled(8, None),
    ]
    for message in messages:
        assert pickle.loads(pickle.dumps(message)) == message
