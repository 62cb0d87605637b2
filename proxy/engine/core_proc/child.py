"""The engine process's side: load the model, report ready, then serve commands until stop or EOF.

OpenMP wait policy: the child runs torch with ``OMP_WAIT_POLICY=PASSIVE`` unless the environment
sets a policy. Measured (default model, 8 streams, 2 cores shared with other work): a decode step took
1.1-2.3 s in the child against 0.2-0.4 s on the in-process engine thread; with PASSIVE, 0.3 s. The
cause is libgomp's active wait: idle OpenMP workers spin (about 300k iterations) at every one of the
step's hundreds of small parallel regions, and when the team has as many threads as there are cores
while other work needs them (the API process's event loop, other processes), the spinning threads
take the CPU from the thread that has work. libgomp shortens the spin by itself only when more
OpenMP threads exist than cores, which is the case in the API process (the loading thread's team plus
the engine thread's) but not in the child, which loads and steps on its main thread. The variable
must be set before torch (libgomp) is loaded, so :func:`child_main` sets it first thing; torch is not
imported by then (the spawn child imports only the ``proxy.engine.core_proc`` package's imports and
the server's ``__main__``, neither of which imports torch; ``ReadyInfo.omp_wait_policy`` reports what
the child ran with).

Signals: the API process owns shutdown. SIGINT and SIGTERM sent to the whole process group (Ctrl-C in
a terminal, ``kill -TERM -PGID``, a supervisor's control group) also reach the child, which ignores
both: the API process drains, then sends ``("stop",)`` (SIGKILL after ``STOP_TIMEOUT_S``, see
``proxy.engine.core_proc.lifecycle``). The child also ends by itself when the API process is gone
(its pipe reports EOF).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from proxy.engine.core_proc.grammar import compile_and_answer
from proxy.engine.core_proc.messages import ReadyInfo, Send, counters_of
from proxy.engine.request import RequestOutput
from proxy.settings import Settings


def set_omp_wait_policy() -> str:
    """Passive OpenMP waiting in this process unless the environment chose (see the module docs).

    Returns the policy torch runs with, or "" when torch was loaded already (too late to set)."""
    if "torch" in sys.modules:
        return os.environ.get("OMP_WAIT_POLICY", "")
    return os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def child_main(settings: Settings, conn: Connection) -> None:
    """Entry point of the engine process: load, report ready, then serve commands until stop/EOF."""
    omp_wait_policy = set_omp_wait_policy()  # before anything imports torch
    # Signals to the whole process group (Ctrl-C, kill -TERM -PGID) reach us too: the API process
    # drains, then stops us with a message; dying here would fail the streams it is draining
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s [engine process]: %(message)s")
    start = time.monotonic()
    try:
        from proxy.engine.core import EngineCore
        from proxy.engine.structured import GrammarCompiler, logits_width
        from proxy.models import load_model
        from proxy.tokenizer import Tokenizer

        conn.send(("progress", "loading the model"))
        loaded = load_model(settings)
        tokenizer = Tokenizer(loaded.hf_tokenizer, generation_eos_ids=loaded.eos_token_ids)
        loaded_s = time.monotonic() - start
        conn.send(("progress", f"model loaded in {loaded_s:.1f} s; building the engine (KV cache)"))
        num_logits = logits_width(loaded.model)
        compiler = GrammarCompiler(loaded.hf_tokenizer, num_logits, tokenizer.eos_token_ids)
        core = EngineCore(loaded.model, settings, tokenizer.eos_token_ids, loaded.max_model_len,
                          grammar_compiler=compiler)
        if settings.self_check:  # as the in-process factory: refuse a model served wrong
            from proxy.engine.selfcheck import run_self_check

            conn.send(("progress", "self-check against generate()"))
            run_self_check(loaded.model, settings, core.max_model_len)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises ModelLoadError
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", ReadyInfo(loaded.model_path, loaded.served_model_name, core.max_model_len,
                                  tuple(sorted(loaded.eos_token_ids)), num_logits,
                                  str(loaded.dtype).removeprefix("torch."), loaded.quantization,
                                  time.monotonic() - start, omp_wait_policy)))
    send_lock = threading.Lock()  # the compile thread answers while the engine loop sends steps

    def send(msg: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(msg)

    try:  # compiles run on the compiler's own (nice 19) threads while the loop steps
        serve(core, conn, send,
              lambda *job: compiler.executor.submit(compile_and_answer, compiler, send, *job))
    except (EOFError, BrokenPipeError):  # the API process is gone
        pass


def serve(core: Any, conn: Connection, send: Send, compile_async: Callable[..., Any]) -> None:
    """The engine loop of the child: apply the parent's commands, step, send the step's outputs.

    Blocks on the pipe while the core has nothing to do; returns on ``("stop",)`` (after failing every
    live request). Raises EOFError or BrokenPipeError when the API process is gone.
    """
    adds_seen = 0
    while True:
        outputs: list[RequestOutput] = []
        if not core.has_unfinished():
            messages = [conn.recv()]  # idle: block until the parent has something
        else:
            messages = []
        while conn.poll():
            messages.append(conn.recv())
        for msg in messages:
            kind = msg[0]
            if kind == "add":
                adds_seen += 1
                try:
                    core.add_request(msg[1], msg[2], msg[3])
                except Exception as exc:  # noqa: BLE001 - reported to that request only
                    outputs.append(RequestOutput(msg[1], [], None, True, "error", len(msg[2]), 0,
                                                 error=str(exc)))
            elif kind == "abort":
                for rid in msg[1]:
                    core.abort_request(rid)
            elif kind == "compile":
                compile_async(msg[1], msg[2], msg[3])
            elif kind == "stop":
                core.fail_all("the engine shut down")
                return
        if core.has_unfinished():
            outputs.extend(core.step())
        send(("step", outputs, counters_of(core, adds_seen)))
