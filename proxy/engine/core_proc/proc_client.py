""":class:`EngineProcClient`: the API process's side of the engine process (see the package docs).

It starts the child (``lifecycle``), reads its step messages on a reader thread and hands each step's
outputs to the event loop, restarts a child that died (unless shutdown has begun), keeps the child's
last counters for ``stats()`` and the 429 rule, and sends adds, aborts, grammar compiles and core
reservations."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
from collections.abc import Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

from proxy.engine import admission
from proxy.engine.client import EngineStats, FaultInjector, OutputsHandler, deliver_outputs
from proxy.engine.core_proc.grammar import PendingCompiles, raise_for_failure
from proxy.engine.core_proc.lifecycle import start_child, stop_child, untrack
from proxy.engine.core_proc.messages import (
    NO_STATS,
    AbortRequests,
    AddRequest,
    Compiled,
    CompileGrammar,
    CoreStats,
    EngineCommand,
    ReadyInfo,
    ReserveCores,
    StepResult,
)
from proxy.engine.request import RequestOutput
from proxy.errors import EngineDeadError
from proxy.media.prompt import PromptImages
from proxy.sampling import SamplingParams, StructuredOutputParams
from proxy.settings import Settings

logger = logging.getLogger(__name__)


class ClientState(enum.Enum):
    """Where the engine process is, as the API process sees it."""

    UP = "up"  # serving
    RESTARTING = "restarting"  # died; a new child is loading
    DEAD = "dead"  # died for good (during shutdown, or the restart failed to load)
    STOPPED = "stopped"  # shut down


class EngineProcClient:
    """:class:`~proxy.engine.client.EngineCoreClient` for an ``EngineCore`` in a child process.

    The constructor starts the child and blocks until it is ready (run it in a worker thread, as
    ``create_app`` runs the engine factory), logging its load progress.

    Args:
        settings: passed to the child, which loads ``settings.model`` with ``proxy.models.load_model``.
        load_nice: the nice value the child loads at, and a restarted child reloads at (0: its
            start's); it serves at its start's priority (``proxy.engine.core_proc.child``).

    Raises:
        proxy.models.ModelLoadError: the child failed to load the model or exited while loading.
    """

    def __init__(self, settings: Settings, load_nice: int = 0) -> None:
        self.settings = settings
        self.load_nice = load_nice
        self.max_waiting = settings.max_waiting
        self.max_num_seqs = settings.max_num_seqs
        # the test hook (a callable: it does not cross processes) is accepted and ignored here
        self.fault_injector: FaultInjector | None = None
        self.num_restarts = 0
        self._live: set[str] = set()
        self._stats: CoreStats = NO_STATS
        self._adds_sent = self._reserves_sent = 0
        self._on_outputs: OutputsHandler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state = ClientState.UP
        self._draining = False  # shutdown has begun: no more restarts
        self._generation = 0
        self._proc: Any = None
        self._launching: Any = None  # the child being loaded (shutdown kills it)
        self._send_lock = threading.Lock()  # one writer at a time on the pipe
        self._compiles = PendingCompiles()
        self._conn: Connection | None = None
        self.info = self._launch()

    # ---- child life cycle -------------------------------------------------------------------------

    def _launch(self) -> ReadyInfo:
        try:
            proc, conn, info = start_child(self.settings, self._on_launch_started, self.load_nice)
        finally:
            self._launching = None
        self._proc, self._conn = proc, conn
        self._adds_sent = self._reserves_sent = 0
        self._stats = info.stats or NO_STATS  # its KV blocks before the first step
        return info

    def _on_launch_started(self, proc: Any) -> None:
        self._launching = proc

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
                match conn.recv():
                    case StepResult(outputs, stats):
                        self._stats = stats
                        if outputs:
                            loop.call_soon_threadsafe(self._dispatch, outputs)
                    case Compiled(token, failure):
                        self._compiles.answer(token, failure)
        except (EOFError, OSError):
            pass
        self._compiles.fail_all("the engine process died while compiling the grammar; retry shortly")
        with contextlib.suppress(RuntimeError, OSError):
            loop.call_soon_threadsafe(self._on_child_exit, generation)

    def _on_child_exit(self, generation: int) -> None:
        """Event loop: the child's pipe closed. Fail every open request; start a new child unless
        shutdown has begun (draining or stopped: the engine then stays dead)."""
        if generation != self._generation or self._state is ClientState.STOPPED:
            return
        proc = self._proc
        proc.join(1.0)
        untrack(proc)
        code = proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        restart = not self._draining
        message = f"the engine process died ({how}); " + (
            "the engine is restarting" if restart else "the server is shutting down")
        logger.error("%s: ending %d open request(s)", message, len(self._live))
        self._state = ClientState.RESTARTING if restart else ClientState.DEAD
        # nothing runs or waits in a dead child: /health and the gauges say so (its cumulative
        # counters stay until the next child reports its own)
        stats = self._stats
        self._stats = replace(stats, num_running=0, num_waiting=0, kv_cache_usage=0.0,
                              num_free_blocks=stats.num_total_blocks, num_adds_taken=self._adds_sent)
        self._dispatch([RequestOutput.failed(rid, message) for rid in self._live])
        if self._conn is not None:
            self._conn.close()
        if restart:
            self.num_restarts += 1
            asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        try:
            await asyncio.to_thread(self._launch)
        except Exception:
            if self._state is ClientState.STOPPED:  # shutdown killed the child while it loaded
                return
            logger.exception("restarting the engine process failed; the engine stays down (/health 503)")
            self._state = ClientState.DEAD
            return
        if self._state is ClientState.STOPPED or self._draining:
            stop_child(self._proc, self._conn, self._send)
            return
        self._start_reader()
        self._state = ClientState.UP
        logger.warning("engine process restarted (restart #%d); serving again", self.num_restarts)

    def begin_drain(self) -> None:
        """Shutdown has begun: the child serves on, but if it dies now it is not restarted."""
        self._draining = True

    def shutdown(self) -> None:
        """Stop the child (it fails its requests; here they end with an error); later adds raise. A
        child still loading (a restart) is killed; one serving gets ``Stop()`` and ``STOP_TIMEOUT_S``
        seconds before SIGKILL (it ignores SIGTERM)."""
        if self._state is ClientState.STOPPED:
            return
        self._state = ClientState.STOPPED
        self._draining = True
        self._dispatch([RequestOutput.failed(rid, "the engine shut down") for rid in self._live])
        self._compiles.fail_all("the engine shut down")
        launching = self._launching
        if launching is not None and launching.is_alive():
            launching.kill()  # the restart thread sees it die and gives up
        stop_child(self._proc, self._conn, self._send)

    @property
    def is_healthy(self) -> bool:
        """True while the child serves (not while it restarts, after it died for good, or after shutdown)."""
        return self._state is ClientState.UP

    @property
    def pid(self) -> int | None:
        """The engine process's pid (tests kill it)."""
        return None if self._proc is None else int(self._proc.pid)

    def stats(self) -> EngineStats:
        """The child's counters as of its last step message."""
        return self._stats.engine_stats(self.num_waiting, self.num_restarts)

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the child plus those sent and not yet taken by it."""
        stats = self._stats  # one snapshot: its waiting and adds taken belong together
        return admission.num_waiting(stats.num_waiting, self._adds_sent, stats.num_adds_taken)

    # ---- event-loop API ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    images: PromptImages | None = None) -> None:
        """Send a request to the child (see ``AsyncEngine.add_request`` for the admission rule).

        Raises:
            EngineDeadError: the engine process is restarting, dead or shut down.
            RateLimitError: the waiting queue is full.
            ValueError: ``request_id`` is already live.
        """
        if self._state is not ClientState.UP or self._conn is None:
            raise EngineDeadError(self._down_message())
        admission.check_admission(self._stats.num_running, self.num_waiting, self.max_num_seqs,
                                  self.max_waiting)
        if request_id in self._live:
            raise ValueError(f"duplicate request id {request_id!r}")
        try:
            self._send(AddRequest(request_id, list(prompt_token_ids), params, images))
        except OSError as exc:  # the child is dying; the reader reports it
            raise EngineDeadError(f"the engine process is not reachable: {exc}") from exc
        self._adds_sent += 1
        self._live.add(request_id)

    def _down_message(self) -> str:
        """Why no request is taken now, and whether retrying here can help."""
        if self._state is ClientState.RESTARTING:
            return "the engine process is restarting; retry shortly"
        if self._state is ClientState.DEAD and not self._draining:
            return ("the engine process died and could not be restarted (see the server log); this "
                    "replica stays down until the server is restarted: send the request elsewhere")
        return "the engine process is not running (the server is shutting down); send the request elsewhere"

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Abort requests (idempotent; unknown or finished ids are ignored). No output follows."""
        ended = [rid for rid in request_ids if rid in self._live]
        if not ended:
            return
        self._live.difference_update(ended)
        if self._state is ClientState.UP and self._conn is not None:
            try:
                self._send(AbortRequests(ended))
            except OSError:  # the child is dying; its requests are gone with it
                pass

    def reserve_cores(self, cores: int) -> None:
        """``CoreDriver.reserve_cores`` in the child; not sent while it is down (it restarts at full)."""
        if self._state is ClientState.UP and self._conn is not None:
            with contextlib.suppress(OSError):  # the child is dying
                self._send(ReserveCores(cores))
                self._reserves_sent += 1

    def cores_reserved(self) -> bool:
        """Every ``reserve_cores`` sent to this child applied (true of a child that is not up)."""
        return self._state is not ClientState.UP or self._stats.num_reserves_taken >= self._reserves_sent

    async def compile_grammar(self, so: StructuredOutputParams, param: str) -> None:
        """Have the child compile (and cache) the grammar of ``so``; returns when it has (event loop).

        Raises:
            InvalidRequestError: the spec cannot be enforced (the message names ``param``).
            EngineDeadError: the engine process is not up, or died or shut down meanwhile.
            RuntimeError: the compiler failed otherwise (a 500).
        """
        token, future = self._compiles.open()
        try:
            if self._state is not ClientState.UP or self._conn is None:
                raise EngineDeadError("the engine process is not running; retry shortly")
            self._send(CompileGrammar(token, so, param))
        except (EngineDeadError, OSError) as exc:
            self._compiles.discard(token)
            raise EngineDeadError(str(exc)) from None
        raise_for_failure(await asyncio.wrap_future(future))

    def _send(self, msg: EngineCommand) -> None:
        assert self._conn is not None
        with self._send_lock:
            self._conn.send(msg)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        deliver_outputs(outputs, self._live, self._on_outputs)
