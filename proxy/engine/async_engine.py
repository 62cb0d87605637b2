"""AsyncEngine: one engine thread stepping an ``EngineCore``, driven from an asyncio event loop.

- ``submit`` / ``abort`` run on the event loop; they only enqueue a command and set a
  ``threading.Event``. The engine thread blocks on that event while it has no work (no spinning)
  and applies the queued commands before each step.
- All outputs of one step reach the event loop with one ``loop.call_soon_threadsafe``; there each
  request's ``on_output(RequestOutput)`` is called.
- A step that raises finishes that step's requests with ``finish_reason="error"`` (``EngineCore``),
  and the engine keeps serving. If the engine loop itself dies, every live request gets an error
  output, ``is_healthy`` turns False and ``submit`` raises ``EngineDeadError``.
- After ``abort(request_id)`` returns, ``on_output`` is never called again for that request; its
  blocks are freed by the engine thread before its next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

from proxy.engine.core import EngineCore
from proxy.engine.request import RequestOutput
from proxy.errors import EngineDeadError, RateLimitError
from proxy.sampling import SamplingParams

logger = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


class AsyncEngine:
    """Runs ``core`` on a dedicated thread.

    Args:
        core: the engine core; from ``start()`` on only the engine thread touches it.
        max_waiting: most requests submitted that cannot start at the next step (beyond the free
            places of the running batch); past it ``submit`` raises ``RateLimitError`` (HTTP 429).
    """

    def __init__(self, core: EngineCore, max_waiting: int) -> None:
        self.core = core
        self.max_waiting = max_waiting
        self._commands: deque[tuple[str, str, Sequence[int] | None, SamplingParams | None]] = deque()
        self._wake = threading.Event()
        self._callbacks: dict[str, OutputCallback] = {}
        self._num_queued = 0  # submitted, not yet handed to the core (event-loop side count)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: str | None = None

    # ---- life cycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the running event loop that will receive outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="streamproxy-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; live requests get a final error output; later submits raise."""
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

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return self.core.num_running

    @property
    def num_waiting(self) -> int:
        """Requests submitted but not running yet."""
        return self.core.num_waiting + self._num_queued

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, in [0, 1]."""
        return self.core.kv_cache_usage

    # ---- event-loop API ---------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        on_output: OutputCallback,
    ) -> None:
        """Queue a request; ``on_output`` gets its outputs on the event loop thread.

        Raises:
            EngineDeadError: the engine died or shut down.
            RateLimitError: the waiting queue is full.
            ContextLengthExceededError, InvalidRequestError: the prompt cannot run (see
                ``EngineCore.check_prompt``).
            ValueError: ``request_id`` is already live.
        """
        if not self.is_healthy:
            raise EngineDeadError(f"the engine is not running{': ' + self._dead if self._dead else ''}")
        # Requests that will start at the next step (free places in the running batch) are not
        # "waiting": a burst into an idle server is admitted whole, up to max_num_seqs + max_waiting.
        free_slots = max(0, self.core.settings.max_num_seqs - self.num_running)
        if self.num_waiting - free_slots >= self.max_waiting:
            raise RateLimitError(
                f"too many requests waiting ({self.max_waiting}); retry later"
            )
        self.core.check_prompt(len(prompt_token_ids))
        if request_id in self._callbacks:
            raise ValueError(f"duplicate request id {request_id!r}")
        self._callbacks[request_id] = on_output
        self._num_queued += 1
        self._commands.append(("add", request_id, list(prompt_token_ids), params))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; unknown or finished ids are ignored). No output follows."""
        if self._callbacks.pop(request_id, None) is None:
            return
        self._commands.append(("abort", request_id, None, None))
        self._wake.set()

    def _dispatch(self, outputs: list[RequestOutput], num_added: int) -> None:
        """Event-loop side of one step's hand-off."""
        self._num_queued -= num_added
        callbacks = self._callbacks
        for out in outputs:
            callback = callbacks.pop(out.request_id, None) if out.finished else callbacks.get(out.request_id)
            if callback is None:
                continue
            try:
                callback(out)
            except Exception:
                logger.exception("on_output callback failed for request %s", out.request_id)

    # ---- engine thread ----------------------------------------------------------------------------

    def _apply_commands(self, outputs: list[RequestOutput]) -> int:
        core = self.core
        num_added = 0
        commands = self._commands
        while commands:
            kind, request_id, prompt, params = commands.popleft()
            if kind == "add":
                num_added += 1
                try:
                    core.add_request(request_id, prompt, params)  # type: ignore[arg-type]
                except Exception as exc:  # noqa: BLE001 - reported to that request only
                    outputs.append(
                        RequestOutput(request_id, [], None, True, "error", len(prompt or ()), 0, error=str(exc))
                    )
            else:
                core.abort_request(request_id)
        return num_added

    def _hand_off(self, outputs: list[RequestOutput], num_added: int) -> None:
        if (outputs or num_added) and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._dispatch, outputs, num_added)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self._stopping = True

    def _run(self) -> None:
        core = self.core
        try:
            while not self._stopping:
                outputs: list[RequestOutput] = []
                num_added = self._apply_commands(outputs)
                if not core.has_unfinished():
                    self._hand_off(outputs, num_added)
                    self._wake.wait()
                    self._wake.clear()
                    continue
                outputs.extend(core.step())
                self._hand_off(outputs, num_added)
        except BaseException as exc:
            logger.exception("engine thread died")
            self._dead = f"{type(exc).__name__}: {exc}"
        message = "the engine shut down" if self._dead is None else f"the engine died: {self._dead}"
        try:
            outputs = []
            self._apply_commands(outputs)
            outputs.extend(core.fail_all(message))
        except Exception:  # noqa: BLE001
            outputs = []
        if self._loop is not None:
            failed = [
                RequestOutput(rid, [], None, True, "error", 0, 0, error=message)
                for rid in list(self._callbacks)
                if rid not in {o.request_id for o in outputs}
            ]
            self._hand_off(outputs + failed, 0)
