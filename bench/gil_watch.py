"""Where a server process stalls the threads that stream: long holds of the interpreter lock, long
garbage collections and long event-loop callbacks, each with the stacks that explain it.

Run a server under it: ``python bench/gil_watch.py OUT.jsonl serve ARGS...`` (``proxy.cli.main``
with the watch installed; ``bench/models_bench.py --gil-watch`` does this). One JSON line per event
is appended to ``OUT.jsonl``, each with ``t`` (``time.monotonic()``, comparable across processes):

- ``hold``: a thread that sleeps 1 ms at a time woke ``ms`` late: ``runqueue_ms`` of it waiting for a
  core (the kernel's ``schedstat`` of the thread: the machine was busy), the rest (``gil_ms``) waiting
  for another thread of the process to let the lock go; ``stacks``: the innermost frames of every
  thread of the process but the ticker (by name; a name two threads share gets the thread's ident),
  as the ticker found them on waking: a thread that held the lock in one long C call has just returned
  from it, so its frame is the caller's, one line on. ``steal_ms``: the time the hypervisor took
  from the machine's vCPUs over the last ``steal_window_ms`` (``/proc/stat``, 10 ms ticks; read
  every :data:`STEAL_EVERY_S`): a guest does not count a vCPU taken away as run-queue wait, so
  ``gil_ms`` holds such time too.
- ``gc``: a collection of ``generation`` that took ``ms``, with the stack of the thread that ran it.
- ``callback``: an event-loop callback (``asyncio.Handle._run``) that ran ``ms``; ``stack``: the
  main thread's frames sampled once while it ran.

Threshold: ``GIL_WATCH_MS`` (default 10). The ticker costs the process a wake-up a millisecond.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any

STACK_DEPTH = 10


def _stack(frame: FrameType | None) -> list[str]:
    if frame is None:
        return []
    def where(path: str) -> str:
        return os.path.relpath(path) if "/proxy/" in path else path.split("site-packages/")[-1]

    frames = traceback.extract_stack(frame, limit=STACK_DEPTH)
    return [f"{where(f.filename)}:{f.lineno} {f.name}" for f in frames]


def _runqueue_s() -> float:
    """Seconds the calling thread has waited on a run queue (``/proc/thread-self/schedstat``'s second
    field); 0 where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


#: how often the ticker reads the machine's steal time (a hold reports the steal since that read)
STEAL_EVERY_S = 0.1


def _steal_s() -> float:
    """Seconds of CPU time the hypervisor took from this machine's vCPUs, summed (``/proc/stat``'s
    ``cpu`` line, 8th field, in clock ticks); 0 where the kernel does not say."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _thread_key(names: dict[int | None, str], ident: int) -> str:
    """A thread's name, with its ident where another live thread has the same name (the loading
    thread and the read-ahead are both ``streamproxy-load``)."""
    name = names.get(ident, str(ident))
    return f"{name} {ident}" if list(names.values()).count(name) > 1 else name


def install(out_path: str, threshold_s: float) -> None:
    """Start the ticker thread, the collector callback and the callback timer (module docs)."""
    out = open(out_path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
    lock = threading.Lock()
    main_id = threading.main_thread().ident or 0  # started: it has one

    def emit(kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, "t": round(time.monotonic(), 4), **fields})
        with lock:
            out.write(line + "\n")

    gc_start: list[float] = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
            return
        ms = (time.perf_counter() - gc_start[0]) * 1000
        if ms >= threshold_s * 200:  # a fifth of the threshold: a collection is a single hold
            emit("gc", ms=round(ms, 1), gil_ms=round(ms, 1), generation=info["generation"],
                 collected=info["collected"], thread=threading.current_thread().name,
                 stack=_stack(sys._getframe()))

    gc.callbacks.append(on_gc)
    running: dict[str, Any] = {}
    original = asyncio.events.Handle._run

    def timed_run(self: asyncio.Handle) -> None:
        start = time.perf_counter()
        running["start"], running["stack"] = start, None
        try:
            original(self)
        finally:
            running["start"] = None
            ms = (time.perf_counter() - start) * 1000
            if ms >= threshold_s * 1000:
                emit("callback", ms=round(ms, 1), callback=repr(self)[:240], stack=running.get("stack"),
                     gil_ms=None)

    asyncio.events.Handle._run = timed_run  # type: ignore[method-assign]

    def tick() -> None:
        steal_at = (time.perf_counter(), _steal_s())  # the machine's steal time, read every STEAL_EVERY_S
        while True:
            start, queued = time.perf_counter(), _runqueue_s()
            time.sleep(0.001)
            now = time.perf_counter()
            frames = None
            if now - start >= threshold_s:
                late, waited = now - start - 0.001, _runqueue_s() - queued
                frames = sys._current_frames()
                names = {t.ident: t.name for t in threading.enumerate()}
                stacks = {_thread_key(names, i): _stack(f) for i, f in frames.items() if i != ticker_id}
                emit("hold", ms=round(late * 1000, 1), runqueue_ms=round(waited * 1000, 1),
                     gil_ms=round(max(0.0, late - waited) * 1000, 1), stacks=stacks,
                     steal_ms=round((_steal_s() - steal_at[1]) * 1000), steal_window_ms=round(
                         (now - steal_at[0]) * 1000))
            if now - steal_at[0] >= STEAL_EVERY_S:
                steal_at = (now, _steal_s())
            began = running.get("start")
            if began is not None and running.get("stack") is None and now - began >= threshold_s / 2:
                frames = frames or sys._current_frames()
                running["stack"] = _stack(frames.get(main_id))

    ticker = threading.Thread(target=tick, name="gil-watch", daemon=True)
    ticker.start()
    ticker_id = ticker.ident


def main() -> int:
    out_path, argv = sys.argv[1], sys.argv[2:]
    install(out_path, float(os.environ.get("GIL_WATCH_MS", "10")) / 1000)
    from proxy.cli import main as proxy_main

    return proxy_main(argv)


if __name__ == "__main__":
    sys.exit(main())
