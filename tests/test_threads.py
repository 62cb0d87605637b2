"""``proxy.threads``: work run at a lower priority on a thread of its own (a several-model server's
loads), which the threads and processes it starts inherit, while the caller keeps its priority."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from proxy.threads import call_at_nice, lower_thread_priority, start_in_own_thread, thread_nice


def _nice_of_what_it_starts() -> tuple[int, int, int, int]:
    """(this thread's nice, a thread's it starts, a child process's, this thread's id)."""
    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.append(thread_nice()))
    worker.start()
    worker.join()
    child = subprocess.run([sys.executable, "-c", "import os; print(os.nice(0))"], check=True,
                           capture_output=True, text=True)
    return thread_nice(), seen[0], int(child.stdout), threading.get_native_id()


def test_call_at_nice_lowers_only_its_own_thread_and_what_that_thread_starts() -> None:
    before = thread_nice()
    if before >= 19:
        pytest.skip("the tests already run at nice 19: nothing lower to see")
    own, started_thread, started_process, tid = call_at_nice(19, _nice_of_what_it_starts)
    assert (own, started_thread, started_process) == (19, 19, 19)
    assert tid != threading.get_native_id()
    assert thread_nice() == before  # the caller (a serving thread) keeps its priority


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
