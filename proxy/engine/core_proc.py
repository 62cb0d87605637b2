"""The engine core in a child process (vLLM v1's ``EngineCoreProc`` / ``MPClient`` split).

:class:`EngineProcClient` is an :class:`~proxy.engine.client.EngineCoreClient`: the child process
runs ``EngineCore`` (schedule, forward, sample) and nothing else; detokenization, stop strings,
framing and metrics stay in the API process (``AsyncEngineClient``'s output processor, the same as
with the in-process thread). The event loop, the SSE work and the engine's Python code then no
longer share one interpreter lock.

Transport: one duplex :func:`multiprocessing.Pipe` (``multiprocessing.connection``, pickle framing).
Why: it is the standard library (no new dependency), it is what ``multiprocessing`` itself uses for
the "spawn" start method that CUDA needs, and the traffic is small: one message per added or aborted
request, and one per engine step carrying that step's ``RequestOutput`` list (a few dozen small
dataclasses) plus a tuple of counters. pickle round-trips our frozen dataclasses (``SamplingParams``,
``RequestOutput``) exactly, so there is no second schema to keep in step (msgspec would need one;
pyzmq's multi-peer sockets buy nothing with one peer).

Messages (tuples, first item the kind):

- parent -> child: ``("add", request_id, prompt_token_ids, params)``, ``("abort", [request_id, ...])``,
  ``("compile", token, StructuredOutputParams, param)``, ``("stop",)``.
- child -> parent: ``("progress", text)`` and one ``("ready", ReadyInfo)`` or ``("failed", text)``
  while loading; then ``("step", [RequestOutput, ...], counters)`` after every engine step and after
  commands that change the counters (an abort frees blocks), and ``("compiled", token, error)``
  (``error`` None, or ``(kind, message, param)``) when a compile finished.

Grammars (structured outputs, tool calls) are compiled once, in the child, where the masks are
applied: the API process has no grammar compiler of its own. ``ChildGrammarCompiler.compile_async``
(awaited by ``AsyncEngineClient.prepare_structured_output`` before ``generate``) sends
``("compile", ...)`` and awaits the answer; the child compiles on its ``GrammarCompiler``'s executor
(nice 19; xgrammar releases the GIL), so its engine loop keeps stepping, caches the grammar and
answers. A refused spec is a 400 naming ``param`` before the request is sent, as in thread mode; the
``add`` that follows finds the grammar in the child's cache. Why not compile in the API process and ship the
result: xgrammar's ``CompiledGrammar.serialize_json`` of a 60-field schema is 27 MB and took 2.5 s
(1 s to load back) against 64 ms to compile it; compiling in both processes (as before) spent the
time twice, the second time on the child's engine loop, stalling every stream.

Recovery when the child dies (SIGKILL, the OOM killer, a crash in native code): the reader thread sees
the pipe close; on the event loop every open request gets a final ``finish_reason="error"`` output
(the streams end with an error event and ``[DONE]`` at once), ``is_healthy`` turns False (``/health``
503, new requests 503), and a new child is started (log line; ``num_engine_restarts`` in the stats,
exported as ``streamproxy:engine_restarts_total``). When it is ready the server serves again. If the
new child fails to load, the engine stays dead (``/health`` 503) and the log says why. Once shutdown
has begun (``begin_drain``, then ``shutdown``) a dead child is never restarted, and ``shutdown`` kills
a child that is still loading.

OpenMP wait policy: the child runs torch with ``OMP_WAIT_POLICY=PASSIVE`` unless the environment
sets a policy. Measured (default model, 8 streams, 2 cores shared with other work): a decode step took
1.1-2.3 s in the child against 0.2-0.4 s on the in-process engine thread; with PASSIVE, 0.3 s. The
cause is libgomp's active wait: idle OpenMP workers spin (about 300k iterations) at every one of the
step's hundreds of small parallel regions, and when the team has as many threads as there are cores
while other work needs them (the API process's event loop, other processes), the spinning threads
take the CPU from the thread that has work. libgomp shortens the spin by itself only when more
OpenMP threads exist than cores, which is the case in the API process (the loading thread's team plus
the engine thread's) but not in the child, which loads and steps on its main thread. The variable
must be set before torch (libgomp) is loaded, so ``_child_main`` sets it first thing; torch is not
imported by then (the spawn child imports only this module's imports and the server's ``__main__``,
neither of which imports torch; ``ReadyInfo.omp_wait_policy`` reports what the child ran with).

Signals: the API process owns shutdown. SIGINT and SIGTERM sent to the whole process group (Ctrl-C in
a terminal, ``kill -TERM -PGID``, a supervisor's control group) also reach the child, which ignores
both: the API process drains, then sends ``("stop",)`` (SIGKILL after ``_STOP_TIMEOUT_S``). The child
also ends by itself when the API process is gone (its pipe reports EOF). Because the child ignores
SIGTERM, ``multiprocessing``'s exit handler (SIGTERM, then an unbounded ``join``) could wait for it
forever; an ``atexit`` hook registered after it SIGKILLs any child still alive first.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from proxy.engine.client import EngineStats, FaultInjector, OutputsHandler, deliver_outputs
from proxy.engine.request import RequestOutput
from proxy.errors import EngineDeadError, InvalidRequestError, RateLimitError
from proxy.sampling import SamplingParams, StructuredOutputParams
from proxy.settings import Settings

logger = logging.getLogger(__name__)

_MP = multiprocessing.get_context("spawn")  # fork is unsafe with torch/CUDA threads already running
_STOP_TIMEOUT_S = 10.0
_children: set[Any] = set()  # engine processes started and not yet reaped (killed at exit)
_atexit_registered = False


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


@dataclass(frozen=True)
class ReadyInfo:
    """What the child reports once its engine is built.

    Attributes:
        model_path: the Hugging Face folder it loaded (the API process loads the tokenizer from it).
        served_model_name: the model's id for clients.
        max_model_len: context length in tokens as the engine enforces it.
        eos_token_ids: the generation config's EOS ids (``LoadedModel.eos_token_ids``).
        logits_width: columns of the model's logits (grammar masks cover them all).
        dtype, quantization: as in ``ModelInfo``.
        load_s: seconds from the child's start to ready.
        omp_wait_policy: ``OMP_WAIT_POLICY`` as torch was loaded in the child (see the module docs);
            "" when torch was loaded before the child could set it.
    """

    model_path: str
    served_model_name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    logits_width: int
    dtype: str
    quantization: str
    load_s: float
    omp_wait_policy: str


# counters sent with every "step" message: running, waiting, kv usage, free blocks, total blocks,
# preemptions, prefix-cache queries, prefix-cache hits, adds consumed so far
_Counters = tuple[int, int, float, int, int, int, int, int, int]
_NO_COUNTERS: _Counters = (0, 0, 0.0, 0, 0, 0, 0, 0, 0)


def _counters(core: Any, adds_seen: int) -> _Counters:
    return (core.num_running, core.num_waiting, core.kv_cache_usage, core.num_free_blocks,
            core.num_total_blocks, core.scheduler.num_preemptions, core.prefix_cache_queries,
            core.prefix_cache_hits, adds_seen)


def _set_omp_wait_policy() -> str:
    """Passive OpenMP waiting in this process unless the environment chose (see the module docs).

    Returns the policy torch runs with, or "" when torch was loaded already (too late to set)."""
    if "torch" in sys.modules:
        return os.environ.get("OMP_WAIT_POLICY", "")
    return os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _child_main(settings: Settings, conn: Connection) -> None:
    """Entry point of the engine process: load, report ready, then serve commands until stop/EOF."""
    omp_wait_policy = _set_omp_wait_policy()  # before anything imports torch
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
        _serve(core, conn, send, lambda *job: compiler.executor.submit(_compile, compiler, send, *job))
    except (EOFError, BrokenPipeError):  # the API process is gone
        pass


def _compile(compiler: Any, send: Any, token: int, so: StructuredOutputParams, param: str) -> None:
    """Compile thread of the child: compile (cached for the ``add`` that follows), then answer."""
    error: tuple[str, str, str | None] | None = None
    try:
        compiler.compile(so, param)
    except InvalidRequestError as exc:
        error = ("invalid", exc.message, exc.param)
    except Exception as exc:  # noqa: BLE001 - reported to that request (a 500 there)
        error = ("error", f"{type(exc).__name__}: {exc}", None)
    with contextlib.suppress(OSError):
        send(("compiled", token, error))


def _serve(core: Any, conn: Connection, send: Any, compile_async: Any) -> None:
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
        send(("step", outputs, _counters(core, adds_seen)))


class EngineProcClient:
    """:class:`~proxy.engine.client.EngineCoreClient` for an ``EngineCore`` in a child process.

    The constructor starts the child and blocks until it is ready (run it in a worker thread, as
    ``create_app`` runs the engine factory), logging its load progress.

    Args:
        settings: passed to the child, which loads ``settings.model`` with ``proxy.models.load_model``.

    Raises:
        proxy.models.ModelLoadError: the child failed to load the model or exited while loading.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.max_waiting = settings.max_waiting
        self.max_num_seqs = settings.max_num_seqs
        # The test hook runs in the engine's forward pass; a callable does not cross processes, so in
        # this mode it is accepted and ignored (fault tests run with the in-process engine).
        self.fault_injector: FaultInjector | None = None
        self.num_restarts = 0
        self._live: set[str] = set()
        self._counters: _Counters = _NO_COUNTERS
        self._adds_sent = 0
        self._on_outputs: OutputsHandler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state = "up"  # "up", "restarting", "dead", "stopped"
        self._draining = False  # shutdown has begun: no more restarts
        self._generation = 0
        self._proc: Any = None
        self._launching: Any = None  # the child being loaded (shutdown kills it)
        self._send_lock = threading.Lock()  # one writer at a time on the pipe
        self._compiles: dict[int, concurrent.futures.Future[tuple[str, str, str | None] | None]] = {}
        self._compile_tokens = itertools.count()
        self._conn: Connection | None = None
        self.info = self._launch()

    # ---- child life cycle -------------------------------------------------------------------------

    def _launch(self) -> ReadyInfo:
        from proxy.models import ModelLoadError

        parent_conn, child_conn = _MP.Pipe()
        proc = _MP.Process(target=_child_main, args=(self.settings, child_conn),
                           name="streamproxy-engine-core", daemon=True)
        proc.start()
        _track(proc)
        self._launching = proc
        child_conn.close()  # our copy closed: the child's death closes the pipe (EOF)
        logger.info("engine process started (pid %d); waiting for it to load the model", proc.pid)
        try:
            while True:
                try:
                    if not parent_conn.poll(1.0):
                        if not proc.is_alive():
                            raise EOFError
                        continue
                    kind, payload = parent_conn.recv()
                except EOFError:
                    proc.join(5)
                    raise ModelLoadError(
                        f"the engine process exited while loading (exit code {proc.exitcode})") from None
                if kind == "progress":
                    logger.info("engine process: %s", payload)
                elif kind == "failed":
                    raise ModelLoadError(f"the engine process failed to load the model: {payload}")
                elif kind == "ready":
                    break
        except BaseException:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
            _children.discard(proc)
            parent_conn.close()
            raise
        finally:
            self._launching = None
        info: ReadyInfo = payload
        logger.info("engine process ready (pid %d) in %.1f s (OpenMP wait policy %s)", proc.pid, info.load_s,
                    info.omp_wait_policy or "unset: torch was loaded before the child could set it")
        self._proc, self._conn = proc, parent_conn
        self._adds_sent = 0
        self._counters = _NO_COUNTERS
        return info

    def start(self, on_outputs: OutputsHandler) -> None:
        """Start reading the child's outputs; call from the running event loop that receives them."""
        self._on_outputs = on_outputs
        self._loop = asyncio.get_running_loop()
        self._start_reader()

    def _start_reader(self) -> None:
        self._generation += 1
        threading.Thread(target=self._read, args=(self._conn, self._generation),
                         name="streamproxy-engine-reader", daemon=True).start()

    def _read(self, conn: Connection, generation: int) -> None:
        """Reader thread: one ``call_soon_threadsafe`` per step message; EOF means the child died."""
        loop = self._loop
        assert loop is not None
        try:
            while True:
                msg = conn.recv()
                if msg[0] == "compiled":
                    future = self._compiles.pop(msg[1], None)
                    if future is not None:
                        future.set_result(msg[2])
                    continue
                _, outputs, counters = msg
                self._counters = counters
                if outputs:
                    loop.call_soon_threadsafe(self._dispatch, outputs)
        except (EOFError, OSError):
            pass
        self._fail_compiles("the engine process died while compiling the grammar; retry shortly")
        with contextlib.suppress(RuntimeError, OSError):
            loop.call_soon_threadsafe(self._on_child_exit, generation)

    def _on_child_exit(self, generation: int) -> None:
        """Event loop: the child's pipe closed. Fail every open request; start a new child unless
        shutdown has begun (draining or stopped: the engine then stays dead)."""
        if generation != self._generation or self._state == "stopped":
            return
        proc = self._proc
        proc.join(1.0)
        _children.discard(proc)
        code = proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        restart = not self._draining
        message = f"the engine process died ({how}); " + (
            "the engine is restarting" if restart else "the server is shutting down")
        logger.error("%s: ending %d open request(s)", message, len(self._live))
        self._state = "restarting" if restart else "dead"
        failed = [RequestOutput(rid, [], None, True, "error", 0, 0, error=message) for rid in self._live]
        self._dispatch(failed)
        if self._conn is not None:
            self._conn.close()
        if restart:
            self.num_restarts += 1
            asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        try:
            await asyncio.to_thread(self._launch)
        except Exception:
            if self._state == "stopped":  # shutdown killed the child while it loaded
                return
            logger.exception("restarting the engine process failed; the engine stays down (/health 503)")
            self._state = "dead"
            return
        if self._state == "stopped" or self._draining:
            self._stop_child()
            return
        self._start_reader()
        self._state = "up"
        logger.warning("engine process restarted (restart #%d); serving again", self.num_restarts)

    def begin_drain(self) -> None:
        """Shutdown has begun: the child serves on, but if it dies now it is not restarted."""
        self._draining = True

    def shutdown(self) -> None:
        """Stop the child (it fails its requests; here they end with an error); later adds raise.

        A child still loading (a restart) is killed; one serving gets ``("stop",)`` and
        ``_STOP_TIMEOUT_S`` seconds before SIGKILL (it ignores SIGTERM)."""
        if self._state == "stopped":
            return
        self._state = "stopped"
        self._draining = True
        failed = [RequestOutput(rid, [], None, True, "error", 0, 0, error="the engine shut down")
                  for rid in self._live]
        self._dispatch(failed)
        self._fail_compiles("the engine shut down")
        launching = self._launching
        if launching is not None and launching.is_alive():
            launching.kill()  # the restart thread sees it die and gives up
        self._stop_child()

    def _stop_child(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(RuntimeError, OSError):
                self._send(("stop",))
        if self._proc is not None:
            self._proc.join(_STOP_TIMEOUT_S)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
            _children.discard(self._proc)
        if self._conn is not None:
            self._conn.close()

    @property
    def is_healthy(self) -> bool:
        """True while the child serves (not while it restarts, after it died for good, or after shutdown)."""
        return self._state == "up"

    @property
    def pid(self) -> int | None:
        """The engine process's pid (tests kill it)."""
        return None if self._proc is None else int(self._proc.pid)

    # ---- counters ---------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The child's counters as of its last step message."""
        running, _, usage, free, total, preemptions, queries, hits, _ = self._counters
        return EngineStats(running, self.num_waiting, usage, free, total, num_preemptions=preemptions,
                           prefix_cache_queries=queries, prefix_cache_hits=hits,
                           num_engine_restarts=self.num_restarts)

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the child plus those sent and not yet taken by it."""
        waiting, adds_seen = self._counters[1], self._counters[-1]
        return waiting + max(0, self._adds_sent - adds_seen)

    # ---- event-loop API ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Send a request to the child (see ``AsyncEngine.add_request`` for the admission rule).

        Raises:
            EngineDeadError: the engine process is restarting, dead or shut down.
            RateLimitError: the waiting queue is full.
            ValueError: ``request_id`` is already live.
        """
        if self._state != "up" or self._conn is None:
            what = {"restarting": "is restarting", "dead": "died"}.get(self._state, "is not running")
            raise EngineDeadError(f"the engine process {what}; retry shortly")
        free_slots = max(0, self.max_num_seqs - self._counters[0])
        if self.num_waiting - free_slots >= self.max_waiting:
            raise RateLimitError(f"too many requests waiting ({self.max_waiting}); retry later")
        if request_id in self._live:
            raise ValueError(f"duplicate request id {request_id!r}")
        try:
            self._send(("add", request_id, list(prompt_token_ids), params))
        except OSError as exc:  # the child is dying; the reader reports it
            raise EngineDeadError(f"the engine process is not reachable: {exc}") from exc
        self._adds_sent += 1
        self._live.add(request_id)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Abort requests (idempotent; unknown or finished ids are ignored). No output follows."""
        ended = [rid for rid in request_ids if rid in self._live]
        if not ended:
            return
        self._live.difference_update(ended)
        if self._state == "up" and self._conn is not None:
            try:
                self._send(("abort", ended))
            except OSError:  # the child is dying; its requests are gone with it
                pass

    async def compile_grammar(self, so: StructuredOutputParams, param: str) -> None:
        """Have the child compile (and cache) the grammar of ``so``; returns when it has (event loop).

        Raises:
            InvalidRequestError: the spec cannot be enforced (the message names ``param``).
            EngineDeadError: the engine process is not up, or died or shut down meanwhile.
            RuntimeError: the compiler failed otherwise (a 500).
        """
        future: concurrent.futures.Future[tuple[str, str, str | None] | None] = concurrent.futures.Future()
        token = next(self._compile_tokens)
        self._compiles[token] = future
        try:
            if self._state != "up" or self._conn is None:
                raise EngineDeadError("the engine process is not running; retry shortly")
            self._send(("compile", token, so, param))
        except (EngineDeadError, OSError) as exc:
            self._compiles.pop(token, None)
            raise EngineDeadError(str(exc)) from None
        error = await asyncio.wrap_future(future)
        if error is None:
            return
        kind, message, err_param = error
        if kind == "invalid":
            raise InvalidRequestError(message, param=err_param)
        if kind == "dead":
            raise EngineDeadError(message)
        raise RuntimeError(f"compiling the grammar failed in the engine process: {message}")

    def _fail_compiles(self, message: str) -> None:
        while self._compiles:
            with contextlib.suppress(KeyError):
                _, future = self._compiles.popitem()
                if not future.done():
                    future.set_result(("dead", message, None))

    def _send(self, msg: tuple[Any, ...]) -> None:
        assert self._conn is not None
        with self._send_lock:
            self._conn.send(msg)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        deliver_outputs(outputs, self._live, self._on_outputs)



class ChildGrammarCompiler:
    """The API process's grammar compiler in engine-process mode: compiles in the engine process.

    ``AsyncEngineClient.prepare_structured_output`` awaits :meth:`compile_async`, which returns once
    the child has compiled and cached the grammar (see the module docs for why the grammar is not
    compiled in this process).
    """

    def __init__(self, client: EngineProcClient) -> None:
        self._client = client

    async def compile_async(self, so: StructuredOutputParams, param: str = "response_format") -> None:
        """See :meth:`EngineProcClient.compile_grammar`."""
        await self._client.compile_grammar(so, param)
