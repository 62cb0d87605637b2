"""Run a function on a new thread that ends when it returns (torch work off a long-lived thread).

Why: torch's OpenMP runtime (libgomp) keeps a team of worker threads for every thread that ran a
parallel region, for as long as that thread lives, and once a process holds more OpenMP threads than
cores it cuts every worker's spin-wait to 1000 iterations. Loading the model in a pool thread that
outlives the load (``asyncio.to_thread``) left its team beside the engine thread's, so every decode
step paid a sleep and wake-up at each of its hundreds of small parallel regions: batch-1 decode of the
default model took 78-89 ms a step against 35 ms when the loading thread had ended (2 cores, same
run). The benchmarks run every system this way too: on a busy machine torch ops issued from the main
thread were measured up to 10x slower than the same ops from a fresh thread.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def start_in_own_thread(fn: Callable[..., T], *args: object, name: str | None = None
                        ) -> concurrent.futures.Future[T]:
    """Start ``fn(*args)`` on a new daemon thread; its result or exception lands in the returned future.

    If the future is cancelled before the thread runs, ``fn`` is not called.
    """
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not done.set_running_or_notify_cancel():  # the waiter cancelled first
            return
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, re-raised there
            done.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


def run_in_own_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on a new thread, waited for; returns its result or re-raises its exception."""
    return start_in_own_thread(fn, *args).result()
