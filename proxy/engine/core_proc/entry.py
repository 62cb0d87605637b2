"""The engine process's entry point, the target ``proxy.engine.core_proc.lifecycle`` spawns.

It imports nothing heavy itself (the standard library and ``proxy.threads``): the load, the imports
of torch, transformers and the engine included, runs in :func:`engine_process_main` through
``proxy.threads.call_at_nice``, on a thread of its own at ``load_nice`` when that is above 0 (a
several-model server's loads yield the cores to the engines serving), and the main thread then
serves at the priority the process started with (``proxy.engine.core_proc.child`` has the rules).

Signals: the API process owns shutdown. SIGINT and SIGTERM sent to the whole process group (Ctrl-C in
a terminal, ``kill -TERM -PGID``, a supervisor's control group) also reach the child, which ignores
both: the API process drains, then sends ``Stop`` (SIGKILL after ``STOP_TIMEOUT_S``, see
``proxy.engine.core_proc.lifecycle``).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from proxy.threads import call_at_nice

if TYPE_CHECKING:
    from proxy.settings import Settings


def engine_process_main(settings: Settings, conn: Connection, load_nice: int = 0,
                        environ: dict[str, str] | None = None) -> None:
    """Entry point of the engine process: take ``environ`` as this process's environment (the API
    process's at the start: a child of the fork server inherits the fork server's, see
    ``proxy.engine.core_proc.lifecycle``), load (at nice ``load_nice`` when above 0, on a thread of its
    own), report ready, then serve commands on the main thread until stop or EOF."""
    if environ is not None:  # before anything reads it (torch, OpenMP, transformers: not loaded yet)
        os.environ.clear()
        os.environ.update(environ)
    # Signals to the whole process group (Ctrl-C, kill -TERM -PGID) reach us too: the API process
    # drains, then stops us with a message; dying here would fail the streams it is draining
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # several models' engine processes log to one terminal: each line names its model
    from proxy.catalog import model_id_of

    name = settings.served_model_name or (model_id_of(settings.model) if settings.model else "default")
    name = name.replace("%", "%%")
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s [engine process {name}]: %(message)s")
    start = time.monotonic()

    def load() -> Any:
        from proxy.engine.core_proc.child import load_engine

        return load_engine(settings, conn)

    engine = call_at_nice(load_nice, load, name="streamproxy-load")
    if engine is None:  # the failure went to the API process
        return
    from proxy.engine.core_proc.child import serve_engine

    serve_engine(engine, settings, conn, time.monotonic() - start)
