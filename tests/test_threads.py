"""``proxy.threads``: work run at a lower priority on a thread of its own (a several-model server's
loads), which the threads and processes it starts inherit, while the caller keeps its priority."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from proxy.threads import call_at_nice, lower_thread_priority, start_in_own_thread, thread_idle, thread_nice

CHILD = "import os; print(os.nice(0), os.sched_getscheduler(0) == os.SCHED_IDLE)"


def _priority_of_what_it_starts() -> tuple[tuple[int, bool], tuple[int, bool], tuple[int, bool], int]:
    """(this thread's (nice, SCHED_IDLE), a thread's it starts, a child process's, this thread's id)."""
    seen: list[tuple[int, bool]] = []
    worker = threading.Thread(target=lambda: seen.append((thread_nice(), thread_idle())))
    worker.start()
    worker.join()
    child = subprocess.run([sys.executable, "-c", CHILD], check=True, capture_output=True, text=True)
    nice, idle = child.stdout.split()
    return (thread_nice(), thread_idle()), seen[0], (int(nice), idle == "True"), threading.get_native_id()


def test_call_at_nice_lowers_only_its_own_thread_and_what_that_thread_starts() -> None:
    before = thread_nice()
    if before >= 19:
        pytest.skip("the tests already run at nice 19: nothing lower to see")
    assert not thread_idle()
    own, started_thread, started_process, tid = call_at_nice(19, _priority_of_what_it_starts)
    # nice 19 and SCHED_IDLE: a core holding only the load counts as idle to a waking serving thread
    assert own == started_thread == started_process == (19, True)
    assert tid != threading.get_native_id()
    assert (thread_nice(), thread_idle()) == (before, False)  # the caller (a serving thread) keeps its own


def test_lower_thread_priority_sets_sched_idle_only_when_asked() -> None:
    def lower(idle: bool) -> tuple[bool, int, bool]:
        return lower_thread_priority(19, idle), thread_nice(), thread_idle()

    assert start_in_own_thread(lower, False).result() == (True, 19, False)  # a grammar compile's
    assert start_in_own_thread(lower, True).result() == (True, 19, True)


def test_call_at_nice_0_runs_here_and_errors_come_back() -> None:
    assert call_at_nice(0, threading.get_native_id) == threading.get_native_id()

    def fail() -> None:
        raise ValueError("no model here")

    with pytest.raises(ValueError, match="no model here"):
        call_at_nice(19, fail)


def test_a_thread_cannot_raise_its_priority_again_so_only_the_loading_thread_lowers_it() -> None:
    """Why the load runs on a thread of its own: once lowered, an unprivileged thread stays lowered
    (``RLIMIT_NICE``), so the thread that serves must never be the one lowered."""

    def lower_then_raise() -> tuple[bool, bool, int]:
        lowered = lower_thread_priority(19)
        return lowered, lower_thread_priority(0), thread_nice()

    if os.geteuid() != 0:
        assert start_in_own_thread(lower_then_raise).result() == (True, False, 19)
        return
    # root (CI, these machines) may raise a priority again: a forked child drops to an unprivileged
    # user, as a server run by one is
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            code = 0 if start_in_own_thread(lower_then_raise).result() == (True, False, 19) else 3
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
