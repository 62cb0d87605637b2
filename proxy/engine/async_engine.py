"""AsyncEngine: one engine thread stepping an ``EngineCore``, driven from an asyncio event loop.

The in-process :class:`~proxy.engine.client.EngineCoreClient`: its calls are messages.

- ``add_request`` / ``abort_requests`` run on the event loop; they only enqueue a command and set a
  ``threading.Event``. The engine thread runs the :class:`~proxy.engine.driver.CoreDriver` loop
  (the engine process runs the same): it blocks on that event while it has no work (no spinning)
  and applies the queued commands before each step. Only the engine thread touches the core
  after ``start()`` (the counters read plain attributes).
- All outputs of one step reach the event loop with one ``loop.call_soon_threadsafe``; there the
  ``on_outputs`` handler given to ``start`` gets them as one list.
- A step that raises finishes that step's requests with ``finish_reason="error"`` (``EngineCore``),
  and the engine keeps serving. If the engine loop itself dies, every live request gets an error
  output, ``is_healthy`` turns False and ``add_request`` raises ``EngineDeadError``.
- After ``abort_requests([request_id])`` returns, no output of that request is handed over; its
  blocks are freed by the engine thread before its next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

from proxy.engine import admission
from proxy.engine.client import EngineStats, OutputsHandler, deliver_outputs
from proxy.engine.core import EngineCore
from proxy.engine.core_proc.messages import (
    AbortRequests,
    AddRequest,
    CoreStats,
    EngineCommand,
    ReserveCores,
    Stop,
)
from proxy.engine.driver import CoreDriver
from proxy.engine.request import RequestOutput
from proxy.errors import EngineDeadError
from proxy.media.prompt import PromptImages
from proxy.sampling import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Runs ``core`` on a dedicated thread.

    Args:
        core: the engine core; from ``start()`` on only the engine thread touches it.
        max_waiting: most requests submitted that cannot start at the next step (beyond the free
            places of the running batch); past it ``add_request`` raises ``RateLimitError`` (HTTP 429).
    """

    def __init__(self, core: EngineCore, max_waiting: int) -> None:
        self.core = core
        self.max_waiting = max_waiting
        self.max_num_seqs = core.settings.max_num_seqs
        self._commands: deque[EngineCommand] = deque()
        self._wake = threading.Event()
        self._live: set[str] = set()  # added and not finished or aborted (event-loop side)
        self._on_outputs: OutputsHandler | None = None
        self._driver = CoreDriver(core, adaptive_threads=core.settings.adaptive_threads)
        self._num_adds_sent = 0  # written on the event loop only (the driver counts those taken)
        self._reserves_sent = 0  # ReserveCores queued (event loop only; the driver counts those applied)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: str | None = None

    # ---- life cycle -------------------------------------------------------------------------------

    def start(self, on_outputs: OutputsHandler) -> None:
        """Start the engine thread; call from the running event loop that will receive outputs.

        ``on_outputs`` gets the outputs of each step (one list per step) on that loop.
        """
        if self._thread is not None:
            return
        self._on_outputs = on_outputs
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="streamproxy-engine", daemon=True)
        self._thread.start()

    def begin_drain(self) -> None:
        """Shutdown has begun; the engine thread serves on until :meth:`shutdown` (nothing to do)."""

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; live requests get a final error output; later adds raise."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def is_healthy(self) -> bool:
        """True while the engine thread runs (or has not been started) and has not died."""
        if self._dead is not None or self._stopping:
            return False
        return self._thread is None or self._thread.is_alive()

    @property
    def fault_injector(self) -> Callable[[], None] | None:
        """Test hook: a callable run before each forward pass; an exception from it fails that step."""
        return self.core.fault_injector

    @fault_injector.setter
    def fault_injector(self, fn: Callable[[], None] | None) -> None:
        self.core.fault_injector = fn

    # ---- counts (read from any thread; approximate while the engine runs) ------------------------

    def stats(self) -> EngineStats:
        """Counters of the core (``/health``, ``/metrics``)."""
        return CoreStats.of(self.core, 0).engine_stats(self.num_waiting)

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return self.core.num_running

    @property
    def num_waiting(self) -> int:
        """Requests added but not running yet."""
        return admission.num_waiting(self.core.num_waiting, self._num_adds_sent, self._driver.num_adds_taken)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, in [0, 1]."""
        return self.core.kv_cache_usage

    # ---- event-loop API ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    images: PromptImages | None = None) -> None:
        """Queue a request; its outputs go to the ``on_outputs`` handler given to ``start``.

        The context check happens in ``EngineCore.add_request`` on the engine thread (a refused
        request finishes with ``finish_reason="error"``); the API checks it before, with the same
        function (``proxy.protocol.resolve_max_tokens``).

        Raises:
            EngineDeadError: the engine died or shut down.
            RateLimitError: the waiting queue is full.
            ValueError: ``request_id`` is already live.
        """
        if not self.is_healthy:
            raise EngineDeadError(f"the engine is not running{': ' + self._dead if self._dead else ''}")
        admission.check_admission(self.num_running, self.num_waiting, self.max_num_seqs, self.max_waiting)
        if request_id in self._live:
            raise ValueError(f"duplicate request id {request_id!r}")
        self._live.add(request_id)
        self._num_adds_sent += 1
        self._commands.append(AddRequest(request_id, list(prompt_token_ids), params, images))
        self._wake.set()

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Abort requests (idempotent; unknown or finished ids are ignored). No output follows."""
        ended = [request_id for request_id in request_ids if request_id in self._live]
        self._live.difference_update(ended)
        if ended:
            self._commands.append(AbortRequests(ended))
        self._wake.set()

    def reserve_cores(self, cores: int) -> None:
        """Leave ``cores`` CPU cores to a model loading beside this one (0: none); see
        ``proxy.engine.driver.CoreDriver.reserve_cores``."""
        self._commands.append(ReserveCores(cores))
        self._reserves_sent += 1
        self._wake.set()

    def cores_reserved(self) -> bool:
        """Every ``reserve_cores`` so far applied by the engine thread."""
        return self._driver.num_reserves_taken >= self._reserves_sent

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Event-loop side of one step's hand-off."""
        deliver_outputs(outputs, self._live, self._on_outputs)

    # ---- engine thread ----------------------------------------------------------------------------

    def _receive(self, block: bool) -> list[EngineCommand]:
        """The commands queued so far (a :class:`Stop` last once shutdown began); with ``block`` and
        none queued, waits for ``add_request`` / ``abort_requests`` / ``shutdown`` first."""
        if block and not self._commands and not self._stopping:
            self._wake.wait()
        self._wake.clear()
        commands = self._commands
        taken: list[EngineCommand] = []
        while commands:
            taken.append(commands.popleft())
        if self._stopping:
            taken.append(Stop())
        return taken

    def _hand_off(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self._stopping = True

    def _run(self) -> None:
        outputs: list[RequestOutput] = []
        try:
            outputs = self._driver.run(self._receive, self._hand_off)
        except BaseException as exc:
            logger.exception("engine thread died")
            self._dead = f"{type(exc).__name__}: {exc}"
        message = "the engine shut down" if self._dead is None else f"the engine died: {self._dead}"
        try:
            self._driver.apply(self._receive(False), outputs)
            outputs.extend(self.core.fail_all(message))
        except Exception:  # noqa: BLE001
            outputs = []
        if self._loop is not None:
            ended = {o.request_id for o in outputs}
            failed = [RequestOutput.failed(rid, message) for rid in list(self._live) if rid not in ended]
            self._hand_off(outputs + failed)
