"""The process's memory: how much the machine has left (:func:`mem_available_bytes`), its own peak
resident set (:func:`peak_rss_bytes`), and the Python heap after start-up: what is alive once the
model is loaded stays out of the cyclic garbage collector's passes.

Why: a loaded server holds ~400 000 long-lived Python objects (torch, transformers, the model's
modules, the compiled step); a full collection (generation 2), which CPython starts now and then
while requests allocate, walked them all in 90-110 ms with the GIL held (2-core Xeon, default model),
stalling every stream's next token: the 16-stream benchmark's p99 inter-token latency was such a
pause (``docs/bench/2026-12-05-cpp-ops.md``). vLLM's engine does the same after its start-up (``gc.freeze``).
"""

from __future__ import annotations

import gc
from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def freeze_heap() -> None:
    """Collect the garbage start-up left (``gc.collect()``), then move every object still alive into
    the collector's permanent generation (``gc.freeze()``), which later collections skip. Objects
    frozen are never freed by the cycle collector (reference counting still frees them); call it
    once, when loading is done."""
    gc.collect()
    gc.freeze()


def mem_available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """``MemAvailable`` of ``meminfo`` in bytes (the kernel's estimate of memory that can be
    allocated without swapping); None when the file or the line is missing or unreadable."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set so far, in bytes (``getrusage``'s ``ru_maxrss``: KiB on Linux,
    the kernel's ``VmHWM``); what a load's high-water mark is reported as (issue 46)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
