"""The kernel's scheduler counters that :mod:`proxy.engine.execution.cpu_threads` reads: the calling thread's
run-queue wait (``/proc/thread-self/schedstat``), and the machine's runnable tasks and busy CPU time
(``/proc/stat``). Linux only; each reader raises where its file is missing.
"""

from __future__ import annotations

import os

SCHEDSTAT = "/proc/thread-self/schedstat"


class RunQueueClock:
    """The calling thread's run-queue wait in nanoseconds, from :data:`SCHEDSTAT` (opened on the
    first read, so construct it anywhere and read it on the thread it measures).

    Raises:
        OSError: from :meth:`wait_ns` where the file does not exist (no schedstat in this kernel).
    """

    def __init__(self, path: str = SCHEDSTAT) -> None:
        self.path = path
        self._fd: int | None = None

    def wait_ns(self) -> int:
        """Nanoseconds this thread has spent runnable but not running, since it started."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return int(os.pread(self._fd, 128, 0).split()[1])

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def procs_running(path: str = "/proc/stat") -> int:
    """Tasks runnable machine-wide now (``procs_running`` of ``/proc/stat``; the reader included).

    Raises:
        OSError, ValueError: the file cannot be read or has no such line.
    """
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(b"procs_running"):
                return int(line.split()[1])
    raise ValueError(f"no procs_running in {path}")


def cpu_busy_ticks(path: str = "/proc/stat") -> int:
    """The machine's busy CPU time since boot in clock ticks (``SC_CLK_TCK`` per second): the
    ``user nice system irq softirq steal`` fields of ``/proc/stat``'s aggregate ``cpu`` line (guest
    time is inside user).

    Raises:
        OSError, ValueError: the file cannot be read or has no such line.
    """
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(b"cpu "):
                fields = [int(x) for x in line.split()[1:9]]
                user, nice, system, _idle, _iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
                return user + nice + system + irq + softirq + steal
    raise ValueError(f"no cpu line in {path}")
