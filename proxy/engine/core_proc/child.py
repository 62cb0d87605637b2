"""The engine process's side: load the model, report ready, then serve commands until stop or EOF
(``proxy.engine.core_proc.entry`` runs :func:`load_engine`, then :func:`serve_engine`).

OpenMP wait policy: the child leaves ``OMP_WAIT_POLICY`` to the environment (libgomp's default when
unset: idle workers spin a while, then sleep). It loads and steps on its main thread, so it holds one
OpenMP team and its workers keep the full spin between a step's hundreds of small parallel regions.
Measured (default model, 2 cores, no other work, same run): batch-1 TPOT 45 ms with the default
policy against 89 ms with ``PASSIVE``, which an earlier version set by default after measuring on a
machine shared with other heavy work (there, spinning workers took the cores from the thread with
work). On a machine shared with other CPU work, set ``OMP_WAIT_POLICY=PASSIVE``.
``ReadyInfo.omp_wait_policy`` reports what the child ran with.

Priority: with ``load_nice`` above 0 (a several-model server's on-demand loads, beside engines that
serve: ``proxy.engine.factory.ON_DEMAND_LOAD_NICE``) the load (the imports of torch, transformers
and the engine, conversion, compile, self-check) runs on a thread of its own at that nice value
(``proxy.threads.call_at_nice``), which its OpenMP team and the compiler processes inductor starts
inherit, and which ends with the load; the main thread, which then serves, keeps the priority the
child started with (an unprivileged process cannot raise a lowered priority again, so the main
thread itself is never lowered). ``ReadyInfo.load_nice`` and ``serve_nice`` report both. Without a
load priority, the main thread loads too (one OpenMP team in the process, as above).

Signals: see ``proxy.engine.core_proc.entry``. The child ends by itself when the API process is gone
(its pipe reports EOF).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from proxy.engine.core_proc.messages import (
    Compiled,
    CompileFailure,
    CompileGrammar,
    CoreStats,
    EngineCommand,
    LoadFailed,
    Progress,
    ReadyInfo,
    Send,
    StepResult,
)
from proxy.engine.driver import CoreDriver
from proxy.engine.request import RequestOutput
from proxy.errors import InvalidRequestError
from proxy.settings import Settings
from proxy.threads import thread_nice


def omp_wait_policy() -> str:
    """``OMP_WAIT_POLICY`` as torch runs with it in this process ("": libgomp's default; see the
    module docs)."""
    return os.environ.get("OMP_WAIT_POLICY", "")


@dataclass
class LoadedEngine:
    """What the load hands the thread that serves.

    Attributes:
        built: the engine as ``proxy.engine.loading.build_core`` assembled it.
        driver: its loop (built on the loading thread: it reads that thread's torch thread count).
        load_nice: the nice value the load ran at.
    """

    built: Any
    driver: CoreDriver
    load_nice: int


def load_engine(settings: Settings, conn: Connection) -> LoadedEngine | None:
    """The load, on the calling thread (the engine process's loading thread: module docs): build the
    engine and its driver, telling the API process each stage; None after reporting ``LoadFailed``."""
    try:
        from proxy.models.device import keep_triton_out

        keep_triton_out(settings)  # before the imports below reach transformers and xgrammar
        from proxy.engine.loading import build_core

        built = build_core(settings, lambda stage: conn.send(Progress(stage)))
        return LoadedEngine(built, CoreDriver(built.core, None, settings.adaptive_threads), thread_nice())
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises ModelLoadError
        conn.send(LoadFailed(f"{type(exc).__name__}: {exc}"))
        return None


def serve_engine(engine: LoadedEngine, settings: Settings, conn: Connection, load_s: float) -> None:
    """Report ready (``load_s``: seconds since the process started), then serve commands on the
    calling thread (the main thread) until stop or EOF."""
    built, driver = engine.built, engine.driver
    loaded, core, compiler = built.loaded, built.core, built.grammar_compiler
    conn.send(ReadyInfo(loaded.model_path, loaded.served_model_name, core.max_model_len,
                        tuple(sorted(loaded.eos_token_ids)), built.num_logits,
                        str(loaded.dtype).removeprefix("torch."), loaded.quantization, load_s,
                        omp_wait_policy(), CoreStats.of(core, 0), core.execution.as_dict(),
                        engine.load_nice, thread_nice()))
    send_lock = threading.Lock()  # the compile thread answers while the engine loop sends steps

    def send(msg: Any) -> None:
        with send_lock:
            conn.send(msg)

    def compile_async(command: CompileGrammar) -> None:
        compiler.executor.submit(compile_and_answer, compiler, send, command)

    driver.compile_grammar = compile_async
    try:  # compiles run on the compiler's own (nice 19) threads while the loop steps
        serve(driver, conn, send)
    except (EOFError, BrokenPipeError):  # the API process is gone
        pass


def serve(driver: CoreDriver, conn: Connection, send: Send) -> None:
    """The engine loop of the child: the driver's loop on the pipe; a ``StepResult`` every turn.

    Blocks on the pipe while the core has nothing to do; returns on ``Stop`` (after failing every
    live request; the API process has already ended their streams). Raises EOFError or
    BrokenPipeError when the API process is gone.
    """

    def receive(block: bool) -> list[EngineCommand]:
        commands = [conn.recv()] if block else []  # idle: block until the parent has something
        while conn.poll():
            commands.append(conn.recv())
        return commands

    def publish(outputs: list[RequestOutput]) -> None:
        send(StepResult(outputs, CoreStats.of(driver.core, driver.num_adds_taken, driver.num_reserves_taken)))

    driver.run(receive, publish)
    driver.core.fail_all("the engine shut down")


def compile_and_answer(compiler: Any, send: Send, command: CompileGrammar) -> None:
    """Compile thread of the child: compile (cached for the ``AddRequest`` that follows), then send
    ``Compiled`` (see ``proxy.engine.core_proc.grammar`` for the API process's half)."""
    failure: CompileFailure | None = None
    try:
        compiler.compile(command.spec, command.param)
    except InvalidRequestError as exc:
        failure = CompileFailure("invalid", exc.message, exc.param)
    except Exception as exc:  # noqa: BLE001 - reported to that request (a 500 there)
        failure = CompileFailure("error", f"{type(exc).__name__}: {exc}")
    with contextlib.suppress(OSError):
        send(Compiled(command.token, failure))
