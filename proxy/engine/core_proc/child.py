"""The engine process's side: load the model, report ready, then serve commands until stop or EOF.

OpenMP wait policy: the child leaves ``OMP_WAIT_POLICY`` to the environment (libgomp's default when
unset: idle workers spin a while, then sleep). It loads and steps on its main thread, so it holds one
OpenMP team and its workers keep the full spin between a step's hundreds of small parallel regions.
Measured (default model, 2 cores, no other work, same run): batch-1 TPOT 45 ms with the default
policy against 89 ms with ``PASSIVE``, which an earlier version set by default after measuring on a
machine shared with other heavy work (there, spinning workers took the cores from the thread with
work). On a machine shared with other CPU work, set ``OMP_WAIT_POLICY=PASSIVE``.
``ReadyInfo.omp_wait_policy`` reports what the child ran with.

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
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from proxy.engine.core_proc.grammar import compile_and_answer
from proxy.engine.core_proc.messages import ReadyInfo, Send, counters_of
from proxy.engine.request import RequestOutput
from proxy.settings import Settings


def omp_wait_policy() -> str:
    """``OMP_WAIT_POLICY`` as torch runs with it in this process ("": libgomp's default; see the
    module docs)."""
    return os.environ.get("OMP_WAIT_POLICY", "")


def child_main(settings: Settings, conn: Connection) -> None:
    """Entry point of the engine process: load, report ready, then serve commands until stop/EOF."""
    wait_policy = omp_wait_policy()
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
        if settings.self_check is not False:  # as the in-process factory: refuse a model served wrong
            from proxy.engine.selfcheck_record import check_at_load

            conn.send(("progress", "self-check against generate() (or its recorded pass)"))
            check_at_load(loaded, settings, core.max_model_len)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises ModelLoadError
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", ReadyInfo(loaded.model_path, loaded.served_model_name, core.max_model_len,
                                  tuple(sorted(loaded.eos_token_ids)), num_logits,
                                  str(loaded.dtype).removeprefix("torch."), loaded.quantization,
                                  time.monotonic() - start, wait_policy)))
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
