"""The adaptive intra-op thread rule (``proxy.engine.execution.cpu_threads``), on a fake clock and a fake
run-queue wait, and once on the real schedstat file of this thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from proxy.engine.execution.cpu_threads import AdaptiveThreads, adaptive_threads_for
from proxy.engine.sched_stats import RunQueueClock, cpu_busy_ticks, procs_running


class FakeMachine:
    """A clock and a run-queue wait counter that steps advance: each step takes ``step_s`` seconds
    and waits ``wait_fraction`` of it on the run queue."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waited_ns = 0
        self.wait_fraction = 0.0
        self.step_s = 0.125  # exact in binary: 8 steps fill a 1 s window
        self.applied: list[int] = []

    def clock(self) -> float:
        return self.now

    def wait_ns(self) -> int:
        return self.waited_ns

    def steps(self, rule: AdaptiveThreads, n: int) -> None:
        for _ in range(n):
            rule.step_started()
            self.now += self.step_s
            self.waited_ns += int(self.step_s * self.wait_fraction * 1e9)
            rule.step_done()


def make(machine: FakeMachine, max_threads: int = 2) -> AdaptiveThreads:
    return AdaptiveThreads(max_threads, machine.wait_ns, machine.applied.append, machine.clock,
                           window_s=1.0, min_steps=4, drop_at=0.10, probe_after_s=5.0,
                           max_probe_after_s=20.0)


def test_free_cores_keep_every_thread() -> None:
    m = FakeMachine()
    m.wait_fraction = 0.02
    rule = make(m)
    m.steps(rule, 200)
    assert rule.threads == 2 and m.applied == []


def test_waiting_drops_a_thread_after_one_window() -> None:
    m = FakeMachine()
    m.wait_fraction = 0.34  # two threads beside one busy process on two cores
    rule = make(m)
    m.steps(rule, 7)  # 0.875 s: the window is not full yet
    assert rule.threads == 2
    m.steps(rule, 1)
    assert rule.threads == 1 and m.applied == [1]


def test_time_between_steps_is_not_measured() -> None:
    m = FakeMachine()
    m.wait_fraction = 0.5
    rule = make(m)
    for _ in range(3):  # an idle engine: long pauses between steps do not fill the window
        m.steps(rule, 1)
        m.now += 100.0
    assert rule.threads == 2


def test_probe_returns_when_the_cores_are_free_and_backs_off_while_they_are_not() -> None:
    m = FakeMachine()
    m.wait_fraction = 0.34
    rule = make(m)
    m.steps(rule, 8)
    assert m.applied == [1]
    m.wait_fraction = 0.0  # one thread never waits, whether or not the other core is busy
    m.steps(rule, 39)  # 4.875 s since the drop: no probe yet
    assert rule.threads == 1
    m.steps(rule, 1)  # 5 s: the full count is tried
    assert m.applied == [1, 2]
    m.wait_fraction = 0.34  # still busy: back to one thread after that one step, next probe 10 s later
    m.steps(rule, 1)
    assert m.applied == [1, 2, 1]
    m.wait_fraction = 0.0
    m.steps(rule, 79)
    assert m.applied == [1, 2, 1]
    m.steps(rule, 1)
    assert m.applied == [1, 2, 1, 2]
    m.steps(rule, 300)  # the cores are free: the full count stays
    assert m.applied == [1, 2, 1, 2] and rule.threads == 2


def test_runnable_count_returns_without_a_probe_step() -> None:
    """With /proc/stat's runnable count, a reduced count returns once the other runnable tasks
    average at most cores - full + FREE_SLACK over free_for_s; a busy process (1 at every read)
    keeps it reduced and no step at the full count ever runs beside it."""
    m = FakeMachine()
    others = [1]
    rule = AdaptiveThreads(2, m.wait_ns, m.applied.append, m.clock, window_s=1.0, min_steps=4,
                           drop_at=0.10, probe_after_s=5.0, runnable=lambda: rule.threads + others[0],
                           cores=2, free_for_s=2.0)
    m.wait_fraction = 0.34
    m.steps(rule, 8)
    assert m.applied == [1]
    m.wait_fraction = 0.0
    m.steps(rule, 400)  # 50 s beside the busy process: no probe
    assert m.applied == [1]
    reads = iter([0, 1, 0, 0] * 100)  # the cores are free; our event loop shows up now and then
    rule._runnable = lambda: rule.threads + next(reads)
    m.steps(rule, 16)  # the window that began while busy ends with a mean above the slack
    assert m.applied == [1]
    m.steps(rule, 17)
    assert m.applied == [1, 2] and rule.threads == 2
    m.wait_fraction = 0.34  # busy again: the wait rule drops as before
    m.steps(rule, 8)
    assert m.applied == [1, 2, 1]


def test_a_short_burst_of_waiting_keeps_every_thread() -> None:
    """The default window is a second of step time: a client's 0.25 s of work beside the engine
    (C22's test: a new httpx client and a request being parsed, 11-19% of a 0.25 s window) does not
    drop a thread; a busy process beside it (0.34 all along) does."""
    m = FakeMachine()
    rule = AdaptiveThreads(2, m.wait_ns, m.applied.append, m.clock)
    m.steps(rule, 4)
    m.wait_fraction = 0.19
    m.steps(rule, 2)
    m.wait_fraction = 0.0
    m.steps(rule, 40)
    assert m.applied == [] and rule.threads == 2
    m.wait_fraction = 0.34
    m.steps(rule, 16)  # within two windows
    assert m.applied == [1]


def test_idle_gap_on_a_free_machine_returns_the_full_count() -> None:
    """A reduced count returns at the first step after an idle gap of at least idle_gap_s when the
    machine's busy CPU time over the gap averaged at most cores - full + FREE_SLACK cores; a busy
    process over the gap (1 core) or a short gap keeps it."""
    m = FakeMachine()
    ticks = [0]
    rule = AdaptiveThreads(2, m.wait_ns, m.applied.append, m.clock, window_s=1.0, min_steps=4,
                           runnable=lambda: rule.threads + 1, cores=2, busy_ticks=lambda: ticks[0],
                           ticks_per_s=100.0, idle_gap_s=1.0)
    m.wait_fraction = 0.34
    m.steps(rule, 8)
    assert m.applied == [1]
    m.wait_fraction = 0.0
    m.now += 3.0  # idle 3 s beside the busy process: 300 ticks of its core
    ticks[0] += 300
    m.steps(rule, 1)
    assert m.applied == [1]
    m.now += 0.5  # too short a gap to judge, though nothing ran
    m.steps(rule, 1)
    assert m.applied == [1]
    m.now += 2.0  # the busy process ended: 0.2 cores of other work over 2 s
    ticks[0] += 40
    m.steps(rule, 1)
    assert m.applied == [1, 2] and rule.threads == 2


def test_an_idle_gap_is_measured_from_a_step_at_the_reduced_count() -> None:
    """After the runnable count brought the full count back, a later drop is not undone at once by
    the idle time before it (the gap's reading is from a step end at the count in use)."""
    m = FakeMachine()
    ticks, others = [0], [1]
    rule = AdaptiveThreads(2, m.wait_ns, m.applied.append, m.clock, window_s=1.0, min_steps=4,
                           runnable=lambda: rule.threads + others[0], cores=2, free_for_s=2.0,
                           busy_ticks=lambda: ticks[0], ticks_per_s=100.0, idle_gap_s=1.0)
    m.wait_fraction = 0.34
    m.steps(rule, 8)
    assert m.applied == [1]
    m.wait_fraction, others[0] = 0.0, 0
    m.steps(rule, 17)  # 2 s of step ends with the cores free: back through the runnable count
    assert m.applied == [1, 2]
    m.now += 30.0  # idle, nothing else running
    m.wait_fraction = 0.34  # then contention: a drop after a window
    m.steps(rule, 8)
    assert m.applied == [1, 2, 1]
    m.steps(rule, 1)  # no idle gap since the drop
    assert m.applied == [1, 2, 1]


def test_real_cpu_busy_ticks_grow_with_work() -> None:
    before = cpu_busy_ticks()
    deadline = time.process_time() + 0.1
    while time.process_time() < deadline:
        pass
    assert cpu_busy_ticks() >= before + 5  # 0.1 s of this process's CPU at 100 ticks/s, at least half counted


def test_real_procs_running_counts_this_thread() -> None:
    assert procs_running() >= 1


def test_back_off_is_capped() -> None:
    m = FakeMachine()
    m.wait_fraction = 0.34
    rule = make(m)
    m.steps(rule, 1600)  # 200 s busy: drops, probes at +5, +10, +20, +20, ...
    drops = m.applied.count(1)
    assert rule.threads == 1
    assert drops >= 8  # capped at 20 s between probes: about (200 - 35) / 21 + 3
    assert rule.changes == len(m.applied)


def test_many_cores_drop_in_proportion() -> None:
    m = FakeMachine()
    m.wait_fraction = 0.25
    rule = make(m, max_threads=8)
    m.steps(rule, 8)
    assert m.applied == [6]  # round(8 * 0.75)


def test_real_schedstat_of_this_thread() -> None:
    clock = RunQueueClock()
    try:
        first = clock.wait_ns()
    except OSError:
        pytest.skip("this kernel has no /proc/thread-self/schedstat")
    assert first >= 0 and clock.wait_ns() >= first
    clock.close()
    clock.close()


def test_rule_applies_on_cpu_with_threads_only() -> None:
    assert adaptive_threads_for(torch.device("cuda")) is None
    results: dict[str, object] = {}

    def on_thread(n: int) -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            results[str(n)] = adaptive_threads_for(torch.device("cpu"))
        finally:
            torch.set_num_threads(before)

    for n in (1, 2):
        worker = threading.Thread(target=on_thread, args=(n,))
        worker.start()
        worker.join()
    assert results["1"] is None
    rule = results["2"]
    try:
        RunQueueClock().wait_ns()
    except OSError:
        assert rule is None
    else:
        assert isinstance(rule, AdaptiveThreads) and rule.max_threads == 2


def test_a_cap_lowers_the_count_the_rule_works_below_it_and_its_lift_returns_the_full_count() -> None:
    """``cap`` (a several-model server leaving a core to a load, ``CoreDriver.reserve_cores``)."""
    m = FakeMachine()
    rule = make(m, max_threads=4)
    rule.cap(3, "a load")
    assert rule.threads == 3 and rule.max_threads == 3 and m.applied == [3]
    m.wait_fraction = 0.34
    m.steps(rule, 8)  # one full window of waiting: below the cap, as below the full count
    assert rule.threads == 2 and m.applied == [3, 2]
    rule.cap(3, "a second load")  # a cap never raises a reduced count
    assert rule.threads == 2
    rule.cap(4, "no load")  # lifted: the full count now
    assert rule.threads == 4 and rule.max_threads == 4 and m.applied == [3, 2, 4]


def test_a_cap_of_one_thread_is_kept_while_steps_wait() -> None:
    m = FakeMachine()
    rule = make(m)
    rule.cap(1, "a load")
    m.wait_fraction = 0.5
    m.steps(rule, 40)  # nothing below one thread, and no probe of the full count while capped
    assert rule.threads == 1 and m.applied == [1]
    rule.cap(0, "below one")
    assert rule.threads == 1 and rule.max_threads == 1
