"""Run a function on a new thread that ends when it returns (torch work off a long-lived thread).

Why: torch's OpenMP runtime (libgomp) keeps a team of worker threads for every thread that ran a
parallel region, for as long as that thread lives, and once a process holds more OpenMP threads than
cores it cuts every worker's spin-wait to 1000 iterations. Loading the model in a pool thread that
outlives the load (``asyncio.to_thread``) left its team beside the engine thread's, so every decode
step paid a sleep and wake-up at each of its hundreds of small parallel regions: batch-1 decode of the
default model took 78-89 ms a step against 35 ms when the loading thread had ended (2 cores, same
run). The benchmarks run every system this way too: on a busy machine torch ops issued from the main
thread were measured up to 10x slower than the same ops from a fresh thread.

Priority: :func:`call_at_nice` runs a function on such a thread at a lower CPU priority (a nice
value of that thread only, and Linux's ``SCHED_IDLE`` policy), for work that must yield the cores to
threads that serve. Why ``SCHED_IDLE`` beside nice 19: the scheduler counts a core that runs only
``SCHED_IDLE`` tasks as idle when it places a waking task (``sched_idle_cpu`` in the kernel's
``select_idle_sibling``), so an OpenMP worker of an engine serving wakes on the core the load holds
and preempts it at once; a nice-19 load is not idle to that test, and the serving team's two threads
were seen sharing one core for tens of milliseconds while the load held the other (``perf sched
timehist``, issue 48: ``docs/bench/2026-12-06-load-start.md``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def thread_nice() -> int:
    """The calling thread's nice value (Linux keeps one per thread: ``getpriority`` of its thread id)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def lower_thread_priority(nice: int, idle: bool = False) -> bool:
    """Set the calling thread's nice value to ``nice`` (-20..19; higher yields more), and with ``idle``
    its scheduling policy to ``SCHED_IDLE`` (module docstring), for this thread only: threads it
    starts and processes it forks from now on inherit both (the OpenMP team of its torch ops,
    inductor's compiler processes), the process's other threads keep theirs. A process without
    ``CAP_SYS_NICE`` may lower its threads' priority but never raise it again (``RLIMIT_NICE`` is 0 by
    default), so only a thread that ends should call this. Returns False where the system refuses or
    has no per-thread priority (the nice value unchanged; a refused ``SCHED_IDLE`` alone leaves the
    nice value set and returns True)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        return False
    if idle:
        with contextlib.suppress(AttributeError, OSError):  # pid 0: the calling thread (Linux)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    return True


def thread_idle() -> bool:
    """Whether the calling thread runs under ``SCHED_IDLE`` (False where the policy is unknown)."""
    try:
        return os.sched_getscheduler(0) == os.SCHED_IDLE
    except (AttributeError, OSError):
        return False


def start_in_own_thread(fn: Callable[..., T], *args: object, name: str | None = None,
                        nice: int | None = None, idle: bool = False) -> concurrent.futures.Future[T]:
    """Start ``fn(*args)`` on a new daemon thread; its result or exception lands in the returned future.

    ``nice``, ``idle``: the thread first lowers its priority to that nice value, and with ``idle`` to
    ``SCHED_IDLE`` (:func:`lower_thread_priority`).
    If the future is cancelled before the thread runs, ``fn`` is not called.
    """
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not done.set_running_or_notify_cancel():  # the waiter cancelled first
            return
        if nice is not None:
            lower_thread_priority(nice, idle)
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, re-raised there
            done.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


def run_in_own_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on a new thread, waited for; returns its result or re-raises its exception."""
    return start_in_own_thread(fn, *args).result()


def call_at_nice(nice: int, fn: Callable[..., T], *args: object, name: str | None = None) -> T:
    """``fn(*args)`` at nice value ``nice`` under ``SCHED_IDLE``: on a new thread that lowers its own
    priority first and ends when ``fn`` returns (the caller's thread keeps its priority,
    :func:`lower_thread_priority`), waited for; ``nice`` 0 or less: here, at the caller's priority.
    Returns ``fn``'s result or re-raises its exception."""
    if nice <= 0:
        return fn(*args)
    return start_in_own_thread(fn, *args, name=name, nice=nice, idle=True).result()
