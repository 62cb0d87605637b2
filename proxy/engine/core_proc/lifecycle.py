"""Starting the engine process and waiting for it to be ready, stopping it, and killing it at exit.

The child is forked by multiprocessing's fork server (the "forkserver" method; forking the API
process itself is unsafe once torch/CUDA threads run): a small Python process started at the first
engine start (:func:`start_fork_server`), before any model serves, that has imported what every
load imports (torch, transformers, the engine: :mod:`proxy.engine.core_proc.fork_server`), so a
load starts at once rather than importing them at idle priority beside the models serving.
Why not "spawn": a spawned child starts a new interpreter at the API process's priority (~150 ms of
one core: the interpreter, ``site``, the imports, before the load lowers its nice value), and a
stream of a model already serving lost one step of 150-210 ms to it on two cores (issue 48; measured
in ``docs/bench/2026-12-06-load-start.md``); a fork of the fork server starts in about a millisecond.
A forked child has the fork server's environment, so the API process's ``os.environ`` at the start
travels with it (:func:`proxy.engine.core_proc.entry.engine_process_main` applies it first); what
the preloaded imports read at import time (OpenMP's variables, Hugging Face's paths:
``IMPORT_ENV_PREFIXES``) is the fork server's, so a fork server whose such variables differ from
the API process's at an engine start is replaced first when none of its children runs (their exit
statuses travel through it), else kept with a warning naming the variables.

Because the child ignores SIGTERM (see ``proxy.engine.core_proc.entry``),
``multiprocessing``'s exit handler (SIGTERM, then an unbounded ``join``) could wait for it forever;
an ``atexit`` hook registered after it SIGKILLs any child still alive first.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from proxy.engine.core_proc.entry import engine_process_main
from proxy.engine.core_proc.messages import LoadFailed, Progress, ReadyInfo, Send, Stop
from proxy.settings import Settings

logger = logging.getLogger(__name__)

_MP = multiprocessing.get_context("forkserver")  # the module docstring says why
_MP.set_forkserver_preload(["proxy.engine.core_proc.fork_server"])

STOP_TIMEOUT_S = 10.0  # a serving child gets this long to stop after Stop() before SIGKILL
_children: set[Any] = set()  # engine processes started and not yet reaped (killed at exit)
_atexit_registered = False
# the variables torch, OpenMP, oneDNN/MKL, Hugging Face's libraries and triton read when imported
# (the dynamic loader's, at the fork server's start); streamproxy reads its own at use
IMPORT_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_", "TORCH", "PYTORCH_",
                       "CUDA_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "TRITON_", "XDG_",
                       "LD_")
# read at every use, and set by importing torch._inductor (proxy.engine.execution.compiled_step)
_READ_AT_USE = frozenset({"TORCHINDUCTOR_CACHE_DIR"})
_fork_server_env: dict[str, str] = {}  # those variables when the fork server of this pid started
_fork_server_pid: int | None = None


def start_fork_server() -> None:
    """Start the fork server now if it does not run (it starts at the first engine start otherwise):
    a several-model server calls it before any model serves, so that its own start (a new
    interpreter and its imports) never runs beside a stream. Replaces a running one whose
    import-time variables differ from ``os.environ``'s when no child of it runs (module docs)."""
    from multiprocessing import forkserver

    global _fork_server_env, _fork_server_pid
    env = {k: v for k, v in os.environ.items() if k.startswith(IMPORT_ENV_PREFIXES)
           and k not in _READ_AT_USE}
    server: Any = forkserver._forkserver  # multiprocessing's one fork server of this process
    old = _fork_server_env
    if server._forkserver_pid is not None and server._forkserver_pid == _fork_server_pid and env != old:
        changed = sorted(k for k in env.keys() | old.keys() if env.get(k) != old.get(k))
        if any(proc.is_alive() for proc in _children):
            logger.warning("the environment changed since the engine processes' fork server started (%s); "
                           "kept while its engine processes run: their imports read the old values",
                           ", ".join(changed))
            return
        logger.info("the environment changed since the fork server started (%s): starting a new one",
                    ", ".join(changed))
        server._stop()
    forkserver.ensure_running()  # (re)starts it when it does not run
    if server._forkserver_pid != _fork_server_pid:
        _fork_server_env, _fork_server_pid = env, server._forkserver_pid


def _kill_children_at_exit() -> None:
    for proc in list(_children):
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _track(proc: Any) -> None:
    """Remember ``proc`` for the exit hook; register the hook once, after ``multiprocessing.util``'s
    own (atexit runs last-registered first, so ours kills before it joins)."""
    global _atexit_registered
    _children.add(proc)
    if not _atexit_registered:
        atexit.register(_kill_children_at_exit)
        _atexit_registered = True


def untrack(proc: Any) -> None:
    """Forget a reaped (or about to be reaped) child: the exit hook no longer kills it."""
    _children.discard(proc)


def start_child(settings: Settings, on_started: Callable[[Any], None],
                load_nice: int = 0) -> tuple[Any, Connection, ReadyInfo]:
    """Start an engine process for ``settings`` and block until it is ready, logging its progress.

    Args:
        settings: passed to the child, which loads ``settings.model``.
        on_started: called with the process once it runs, before the wait (shutdown kills it there).
        load_nice: the nice value the child loads at (0: its start's); it serves at its start's
            priority, this thread's (``proxy.engine.core_proc.child``).

    Returns:
        the process, the parent's end of its pipe, and its ``ReadyInfo``.

    Raises:
        proxy.models.ModelLoadError: the child failed to load the model or exited while loading
            (it is killed and reaped, the pipe closed).
    """
    from proxy.models import ModelLoadError

    start_fork_server()
    parent_conn, child_conn = _MP.Pipe()
    proc = _MP.Process(target=engine_process_main, args=(settings, child_conn, load_nice, dict(os.environ)),
                       name="streamproxy-engine-core", daemon=True)
    proc.start()
    _track(proc)
    on_started(proc)
    child_conn.close()  # our copy closed: the child's death closes the pipe (EOF)
    logger.info("engine process started (pid %d); waiting for it to load the model", proc.pid)
    try:
        while True:
            try:
                if not parent_conn.poll(1.0):
                    if not proc.is_alive():
                        raise EOFError
                    continue
                msg = parent_conn.recv()
            except EOFError:
                proc.join(5)
                raise ModelLoadError(
                    f"the engine process exited while loading (exit code {proc.exitcode})") from None
            match msg:
                case Progress(text):
                    logger.info("engine process: %s", text)
                case LoadFailed(reason):
                    raise ModelLoadError(f"the engine process failed to load the model: {reason}")
                case ReadyInfo():
                    info = msg
                    break
    except BaseException:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        untrack(proc)
        parent_conn.close()
        raise
    logger.info("engine process ready (pid %d) in %.1f s (loaded at nice %d, serving at nice %d; OpenMP "
                "wait policy %s)", proc.pid, info.load_s, info.load_nice, info.serve_nice,
                info.omp_wait_policy or "libgomp's default")
    return proc, parent_conn, info


def stop_child(proc: Any, conn: Connection | None, send: Send) -> None:
    """Stop a serving child: ``Stop()`` through ``send`` (it fails its requests and exits), SIGKILL
    after ``STOP_TIMEOUT_S`` (it ignores SIGTERM); then close ``conn``. ``proc``/``conn`` may be None."""
    if conn is not None:
        with contextlib.suppress(RuntimeError, OSError):
            send(Stop())
    if proc is not None:
        proc.join(STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        untrack(proc)
    if conn is not None:
        conn.close()
