""":class:`CoreDriver`: the one loop around ``EngineCore.step()``, for the engine thread
(``proxy.engine.async_engine``) and the engine process (``proxy.engine.core_proc.child``).

Each turn: take the commands that arrived (blocking while the core has nothing to do), apply them
in order, step once if any request waits or runs, publish that turn's outputs. The two hosts differ
only in where commands come from and where outputs go (a deque and ``call_soon_threadsafe``; a pipe).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from proxy.engine.core_proc.messages import (
    AbortRequests,
    AddRequest,
    CompileGrammar,
    EngineCommand,
    ReserveCores,
    Stop,
)
from proxy.engine.execution.cpu_threads import (
    AdaptiveThreads,
    adaptive_threads_for,
    apply_thread_count,
    builder_thread_count,
)
from proxy.engine.request import RequestOutput

logger = logging.getLogger(__name__)

Receive = Callable[[bool], Iterable[EngineCommand]]  # block: wait for a command when there is none
Publish = Callable[[list[RequestOutput]], None]


class CoreDriver:
    """Applies commands to an ``EngineCore`` and steps it, on the one thread that owns the core.

    Args:
        core: the ``EngineCore`` (only this driver's thread touches it).
        compile_grammar: runs a :class:`CompileGrammar` (the engine process); None: none arrive.
        adaptive_threads: step under :class:`proxy.engine.execution.cpu_threads.AdaptiveThreads` where it
            applies (``Settings.adaptive_threads``; the core's ``runner.device`` is read).

    Attributes:
        num_adds_taken: ``AddRequest`` commands taken so far, counted before the core queues each
            (``proxy.engine.admission.num_waiting``); written by the driver's thread only.
        num_reserves_taken: ``ReserveCores`` commands applied so far (the sender's acknowledgement).
        num_threads: torch intra-op threads of the thread that built the driver (the one that
            loaded the model), applied on the thread that runs it
            (``proxy.engine.execution.cpu_threads.builder_thread_count``); None off the CPU.
    """

    def __init__(self, core: Any, compile_grammar: Callable[[CompileGrammar], None] | None = None,
                 adaptive_threads: bool = True) -> None:
        self.core = core
        self.compile_grammar = compile_grammar
        self.adaptive_threads = adaptive_threads
        self.num_adds_taken = 0
        self.num_reserves_taken = 0
        runner = getattr(core, "runner", None)  # None: a core on no device (tests' scripted cores)
        self.device = runner.device if runner is not None else None
        self.num_threads = builder_thread_count(self.device) if self.device is not None else None
        self._adaptive: AdaptiveThreads | None = None

    def run(self, receive: Receive, publish: Publish) -> list[RequestOutput]:
        """Serve until a :class:`Stop`: ``receive(block)``, apply, step, ``publish(outputs)`` (every
        turn, also with no outputs).

        Returns:
            the outputs of the commands applied before the ``Stop`` (refused adds), unpublished.
        """
        core = self.core
        apply_thread_count(self.num_threads)
        threads = None
        if self.adaptive_threads and self.device is not None:
            threads = self._adaptive = adaptive_threads_for(self.device)
        while True:
            outputs: list[RequestOutput] = []
            if self.apply(receive(not core.has_unfinished()), outputs):
                return outputs
            if core.has_unfinished():
                if threads is not None:
                    threads.step_started()
                outputs.extend(core.step())
                if threads is not None:
                    threads.step_done()
            publish(outputs)

    def apply(self, commands: Iterable[EngineCommand], outputs: list[RequestOutput]) -> bool:
        """Apply ``commands`` in order, appending their outputs; True when one is a :class:`Stop`
        (the commands after it are left)."""
        core = self.core
        for command in commands:
            match command:
                case AddRequest(request_id, prompt_token_ids, params, images):
                    self.num_adds_taken += 1
                    try:
                        core.add_request(request_id, prompt_token_ids, params, images)
                    except Exception as exc:  # noqa: BLE001 - reported to that request only
                        outputs.append(RequestOutput.failed(request_id, str(exc), len(prompt_token_ids)))
                case AbortRequests(request_ids):
                    for request_id in request_ids:
                        core.abort_request(request_id)
                case CompileGrammar():
                    if self.compile_grammar is None:
                        logger.error("a grammar compile reached an engine without a compile thread")
                    else:
                        self.compile_grammar(command)
                case ReserveCores(cores):
                    self.reserve_cores(cores)
                    self.num_reserves_taken += 1
                case Stop():
                    return True
        return False

    def reserve_cores(self, cores: int) -> None:
        """Step with at most ``num_threads - cores`` intra-op threads (at least one) until the next
        call; 0: the full count (under the adaptive rule, which keeps working below the cap). Why: a
        model loading beside this one on a machine of few cores (``proxy.api.multi``) gets cores
        only when the serving engines leave them: a torch team's workers spin between the ops of a
        step and hold every core they have, so a load at idle priority beside a 2-thread step on 2
        cores made no progress until the stream ended. No effect off the CPU; a row's bits do not
        depend on the thread count (``proxy.engine.execution.cpu_threads``)."""
        if self.num_threads is None:
            return
        cap = max(1, self.num_threads - max(0, cores))
        if self._adaptive is not None:
            self._adaptive.cap(cap, f"{cores} core(s) left to a model loading" if cores > 0 else "no load")
        else:
            apply_thread_count(cap)
