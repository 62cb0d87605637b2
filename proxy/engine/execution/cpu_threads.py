"""Adaptive intra-op threads on the CPU: fewer torch threads while other work holds the cores.

Why: torch's CPU kernels run each op as an OpenMP team whose threads meet at a barrier; a decode
step is hundreds of such ops. When another process takes one of the cores, one member of the team is
descheduled for a whole time slice and every other member waits at the next barrier, so a 2-thread
step slows far more than the lost share of one core (measured: ``docs/threads.md``). With one thread
per core left free, nobody waits for a partner.

The signal is the engine thread's own **run-queue wait** (``/proc/thread-self/schedstat``, second
field: nanoseconds the thread was runnable but not running), summed over its steps: near 0 when the
team has its cores, about a third of the step time beside one busy process on two cores. The rule,
applied by :meth:`AdaptiveThreads.step_done` after each engine step:

- measure windows of at least :attr:`AdaptiveThreads.window_s` seconds of step time (and
  :attr:`AdaptiveThreads.min_steps` steps); when a window's wait fraction ``f`` is above
  :attr:`AdaptiveThreads.drop_at`, use ``max(1, round(threads * (1 - f)))`` threads (at least one fewer);
- while below the full count, a thread that finds a free core never waits, so the wait cannot say
  when the cores are free again. Where ``/proc/stat`` is readable, the mean count of other runnable
  tasks at step ends over :attr:`AdaptiveThreads.free_for_s` seconds says it (at most
  ``cores - threads + FREE_SLACK``: back to the full count). Elsewhere, after
  :attr:`AdaptiveThreads.probe_after_s` seconds the full count runs one step; if it waits again the
  reduced count returns and the next probe comes twice as late (up to
  :attr:`AdaptiveThreads.max_probe_after_s`), otherwise the full count stays;
- a reduced count also returns at the first step after the engine sat idle for at least
  :attr:`AdaptiveThreads.idle_gap_s` seconds when, over that gap, the machine's busy CPU time
  (``/proc/stat``'s ``cpu`` line; the idle engine adds almost none) averaged at most
  ``cores - threads + FREE_SLACK`` cores: a busy process that ended while no request ran no longer
  costs the next request's prefill its second thread.

Changing the thread count does not change a row's bits on the machines measured (``docs/threads.md``);
the engine's batch-invariance rules are about which rows share a step, not about threads.
On by default (``Settings.adaptive_threads``; ``--no-adaptive-threads`` keeps the full count;
measured in ``docs/threads.md``); never on CUDA, with one thread, or where the kernel has no
schedstat file. Where ``/proc/stat`` is readable the return to the full count needs no probe step:
the machine-wide runnable count at step ends says whether the other cores are free
(:class:`AdaptiveThreads`' ``runnable``); a probe at the full count beside a busy process was one
step of several seconds at 16 streams.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from proxy.engine.sched_stats import SCHEDSTAT, RunQueueClock, cpu_busy_ticks, procs_running

logger = logging.getLogger(__name__)

#: other runnable tasks a free machine may show on average at step ends (the server's own event
#: loop, a client); one busy process shows 1 at every read
FREE_SLACK = 0.5


class AdaptiveThreads:
    """The rule of the module docstring, driven by the engine thread after every step.

    Args:
        max_threads: the full count (``Settings.num_threads`` or torch's default).
        wait_ns: the engine thread's cumulative run-queue wait (:class:`RunQueueClock`).
        set_threads: applies a count on the engine thread (``torch.set_num_threads``).
        clock: monotonic seconds.
        window_s, min_steps, drop_at, probe_after_s, max_probe_after_s: the rule's constants.
        runnable: tasks runnable machine-wide now (:func:`procs_running`); with it a reduced count
            returns to the full one when, over ``free_for_s`` seconds of step ends, the mean of
            ``runnable() - threads`` plus ``max_threads`` is at most ``cores + FREE_SLACK``; no
            probe step runs. None: probes.
        cores: the CPUs this process may use (``os.sched_getaffinity``).
        busy_ticks: the machine's busy CPU time in clock ticks (:func:`cpu_busy_ticks`); None: a
            reduced count does not return over an idle gap.
        ticks_per_s: clock ticks per second (``SC_CLK_TCK``).
        idle_gap_s: the shortest gap between steps that is judged by ``busy_ticks``.

    Attributes:
        threads: the count in use now.
        max_threads: the count the rule returns to: ``full_threads`` (the argument) unless
            :meth:`cap` lowered it.
        changes: how many times the count changed (for logs and tests).
    """

    def __init__(
        self,
        max_threads: int,
        wait_ns: Callable[[], int],
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
        *,
        window_s: float = 1.0,
        min_steps: int = 2,
        drop_at: float = 0.10,
        probe_after_s: float = 5.0,
        max_probe_after_s: float = 80.0,
        runnable: Callable[[], int] | None = None,
        cores: int = 0,
        free_for_s: float = 2.0,
        busy_ticks: Callable[[], int] | None = None,
        ticks_per_s: float = 100.0,
        idle_gap_s: float = 1.0,
    ) -> None:
        self.full_threads = self.max_threads = max_threads
        self.threads = max_threads
        self._wait_ns = wait_ns
        self._set_threads = set_threads
        self._clock = clock
        self.window_s = window_s
        self.min_steps = min_steps
        self.drop_at = drop_at
        self.probe_after_s = probe_after_s
        self.max_probe_after_s = max_probe_after_s
        self._probe_gap = probe_after_s
        self._runnable = runnable
        self.cores = cores
        self.free_for_s = free_for_s
        self._free_since: float | None = None
        self._busy_ticks = busy_ticks
        self.ticks_per_s = ticks_per_s
        self.idle_gap_s = idle_gap_s
        self._last_done: tuple[float, int] | None = None  # (clock, busy ticks) at a reduced step's end
        self._others = self._reads = 0
        self._next_probe = 0.0
        self._probing = False
        self._step_start: tuple[float, int] | None = None
        self._busy_s = 0.0
        self._waited_ns = 0
        self._steps = 0
        self.changes = 0

    def step_started(self) -> None:
        """Mark the start of an engine step (the time between steps is not measured, except by the
        idle-gap rule of the module docstring)."""
        if self._last_done is not None and self._busy_ticks is not None and self.threads < self.max_threads:
            done_at, done_ticks = self._last_done
            gap = self._clock() - done_at
            if gap >= self.idle_gap_s:
                self._last_done = None
                others = (self._busy_ticks() - done_ticks) / self.ticks_per_s / gap
                if others + self.max_threads <= self.cores + FREE_SLACK:
                    self._free_since, self._others, self._reads = None, 0, 0
                    self._apply(self.max_threads, f"the other work used {others:.2f} cores on average "
                                f"over {gap:.1f} s with the engine idle")
        self._step_start = (self._clock(), self._wait_ns())

    def step_done(self) -> None:
        """Account the step that :meth:`step_started` began; change the count when the rule says."""
        if self._step_start is None:
            return
        started, waited = self._step_start
        self._step_start = None
        now = self._clock()
        self._busy_s += now - started
        self._waited_ns += self._wait_ns() - waited
        self._steps += 1
        if self.threads < self.max_threads and self._busy_ticks is not None:
            self._last_done = (now, self._busy_ticks())
        if self.threads < self.max_threads and self._runnable is not None:
            self._reset_window()
            # runnable tasks machine-wide, less ours (this thread and the team it leads); our own
            # event loop and clients show up now and then, a busy process at every read
            self._others += self._runnable() - self.threads
            self._reads += 1
            if self._free_since is None:
                self._free_since = now
            elif now - self._free_since >= self.free_for_s:
                mean = self._others / self._reads
                self._free_since, self._others, self._reads = None, 0, 0
                if mean + self.max_threads <= self.cores + FREE_SLACK:
                    self._apply(self.max_threads, f"{mean:.2f} other runnable tasks on average "
                                f"over {self.free_for_s:g} s")
            return
        if self.threads < self.max_threads:
            if now >= self._next_probe:  # try the full count for one step
                self._probing = True
                self._apply(self.max_threads, "probing whether the cores are free again")
            self._reset_window()
            return
        if self.max_threads < 2:  # one thread (capped): nothing to drop to
            self._reset_window()
            return
        if not self._probing and (self._busy_s < self.window_s or self._steps < self.min_steps):
            return  # a probe is judged on its first step: under contention a step at the full
            # count is the slow kind (it may be a whole prompt's prefill)
        fraction = self._waited_ns / 1e9 / self._busy_s
        self._reset_window()
        if fraction > self.drop_at:
            reduced = min(self.max_threads - 1, max(1, round(self.max_threads * (1 - fraction))))
            if self._probing:
                self._probe_gap = min(self._probe_gap * 2, self.max_probe_after_s)
            self._next_probe = now + self._probe_gap
            self._probing = False
            self._apply(reduced, f"the engine thread waited {fraction:.0%} of its step time for a CPU")
        elif self._probing:
            self._probing = False
            self._probe_gap = self.probe_after_s
            logger.info("engine threads stay at %d: the cores are free again", self.threads)

    def cap(self, limit: int, why: str) -> None:
        """Run at most ``limit`` threads (at least 1, at most the full count) until the next call: the
        count the rule returns to, applied now where fewer run; the full count lifts the cap and is
        applied now (a reduced count starts over from it, as at the start)."""
        limit = max(1, min(limit, self.full_threads))
        self.max_threads = limit
        self._free_since, self._others, self._reads = None, 0, 0
        self._probing, self._probe_gap, self._next_probe = False, self.probe_after_s, 0.0
        self._last_done = None
        self._reset_window()
        now = limit if limit == self.full_threads else min(limit, self.threads)
        self._apply(now, f"at most {limit}: {why}")

    def _reset_window(self) -> None:
        self._busy_s = 0.0
        self._waited_ns = 0
        self._steps = 0

    def _apply(self, threads: int, why: str) -> None:
        if threads == self.threads:
            return
        logger.info("engine threads %d -> %d: %s", self.threads, threads, why)
        self._set_threads(threads)
        self.threads = threads
        self.changes += 1
        self._last_done = None  # an idle gap is measured from a step end at this count


def adaptive_threads_for(device: torch.device) -> AdaptiveThreads | None:
    """The engine thread's :class:`AdaptiveThreads`, or None where the rule does not apply (not a
    CPU, one thread, no schedstat file). Call on the engine thread (it reads that thread's torch
    thread count)."""
    if device.type != "cpu":
        return None
    threads = torch.get_num_threads()
    if threads < 2:
        return None
    clock = RunQueueClock()
    try:
        clock.wait_ns()
    except (OSError, IndexError, ValueError):
        logger.info("adaptive threads off: %s is not readable", SCHEDSTAT)
        return None
    try:
        procs_running()
        runnable: Callable[[], int] | None = procs_running
    except (OSError, ValueError):
        runnable = None  # the rule probes instead
    try:
        cpu_busy_ticks()
        busy_ticks: Callable[[], int] | None = cpu_busy_ticks
    except (OSError, ValueError):
        busy_ticks = None
    return AdaptiveThreads(threads, clock.wait_ns, runnable=runnable, cores=len(os.sched_getaffinity(0)),
                           busy_ticks=busy_ticks, ticks_per_s=float(os.sysconf("SC_CLK_TCK")))


def builder_thread_count(device: torch.device) -> int | None:
    """The calling thread's torch intra-op thread count on the CPU (None elsewhere): read on the thread
    that loaded the model and built the engine (``--num-threads`` or torch's default), then applied on
    the thread that steps it (:func:`apply_thread_count`).

    Why: torch gives a thread its count at the thread's first parallel op, from a process-wide value
    that every ``torch.set_num_threads`` call overwrites. The embedding worker sets 1 for its own
    thread when it starts, about when the chat engine's thread starts, and the engine then stepped
    on one thread: 7 threads in the server, the engine's the only one busy (``/proc/PID/task``).
    """
    return torch.get_num_threads() if device.type == "cpu" else None


def apply_thread_count(count: int | None) -> None:
    """Give the calling thread ``count`` torch intra-op threads (``torch.set_num_threads``, which sets
    the calling thread's OpenMP and MKL counts); None: leave it as it is."""
    if count is not None and count != torch.get_num_threads():
        torch.set_num_threads(count)
