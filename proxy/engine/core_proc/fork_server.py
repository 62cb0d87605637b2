"""What the fork server that starts engine processes imports before its first fork
(``proxy.engine.core_proc.lifecycle``: multiprocessing's "forkserver" preload). Imported by that
process only: importing it sets SIGTERM to be ignored there.

Why ignore SIGTERM: a signal to the whole process group (``kill -TERM -PGID``, a supervisor's
control group) reaches the fork server too; multiprocessing's fork server keeps SIGTERM's default
action and would die, and its death reads to the API process as the death of every engine process
it forked (their exit statuses travel through it), while the API process is draining those engines'
streams. It exits on its own when the API process does (the pipe multiprocessing keeps for that
closes). The engine processes it forks set their own handlers (``proxy.engine.core_proc.entry``).
"""

from __future__ import annotations

import signal

import proxy.engine.core_proc.entry  # noqa: F401 - imported once here, not in every engine process

signal.signal(signal.SIGTERM, signal.SIG_IGN)
