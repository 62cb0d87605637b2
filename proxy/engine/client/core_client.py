"""The seam to the engine core: :class:`EngineCoreClient` (messages in, step outputs out).

Both engine modes implement it: ``proxy.engine.async_engine.AsyncEngine`` (the core on a thread)
and ``proxy.engine.core_proc.proc_client.EngineProcClient`` (the core in a child process); the test
double is ``tests/api/fakes.FakeEngine``. :func:`deliver_outputs` is the step hand-off they share, and
:class:`EngineStats` the counters they report. ``proxy.engine.client.AsyncEngineClient`` drives it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from proxy.engine.request import RequestOutput
from proxy.media.prompt import PromptImages
from proxy.sampling import SamplingParams

OutputsHandler = Callable[[list[RequestOutput]], None]
FaultInjector = Callable[[], None]

logger = logging.getLogger(__name__)


def deliver_outputs(outputs: list[RequestOutput], live: set[str], on_outputs: OutputsHandler | None) -> None:
    """Hand one step's outputs to ``on_outputs`` on the event loop (both engine core clients' seam).

    Outputs of requests no longer in ``live`` (aborted meanwhile) are dropped; a finished request leaves
    ``live``. An exception of the handler is logged, never raised into the engine's hand-off.
    """
    delivered = [o for o in outputs if o.request_id in live]
    for out in delivered:
        if out.finished:
            live.discard(out.request_id)
    if delivered and on_outputs is not None:
        try:
            on_outputs(delivered)
        except Exception:
            logger.exception("output processing failed for a step of %d outputs", len(delivered))


@dataclass(frozen=True)
class EngineStats:
    """Counters of the engine, for ``/health`` and the ``/metrics`` gauges.

    Attributes:
        num_running: requests in the running batch.
        num_waiting: requests admitted but not running yet.
        kv_cache_usage: fraction of KV blocks in use, in [0, 1].
        num_free_blocks, num_total_blocks: KV blocks (None: the core does not say).
        num_tracked_outputs: engine requests whose outputs output processing still expects.
        num_preemptions: requests preempted (recomputed) so far because the KV cache ran out; a
            growing count means the cache is too small for the load (vLLM's ``num_preemptions``).
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up in the prefix cache and
            found there, since start.
        num_engine_restarts: times the engine process died and was restarted (``--engine-process``).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int | None = None
    num_total_blocks: int | None = None
    num_tracked_outputs: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_engine_restarts: int = 0


@runtime_checkable
class EngineCoreClient(Protocol):
    """The seam to the engine core (schedule, forward, sample): messages in, step outputs out.

    ``start`` and every call run on the event loop; ``on_outputs`` gets each step's outputs on the
    event loop, once per step. After ``abort_requests`` returns, no output of those requests is
    delivered. Implementations: ``AsyncEngine`` (a thread), ``EngineProcClient`` (a child process,
    ``proxy.engine.core_proc``), the test double ``FakeEngine``.
    """

    fault_injector: FaultInjector | None  # test hook: run before each forward pass

    @property
    def is_healthy(self) -> bool: ...

    def start(self, on_outputs: OutputsHandler) -> None: ...

    def begin_drain(self) -> None:
        """Shutdown has begun: keep serving open requests, but never restart a dead engine again."""

    def shutdown(self) -> None: ...

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    images: PromptImages | None = None) -> None:
        """Queue a request (``images``: its prompt's images). Raises RateLimitError (queue full) or
        EngineDeadError."""

    def abort_requests(self, request_ids: Sequence[str]) -> None: ...

    def reserve_cores(self, cores: int) -> None:
        """Leave ``cores`` CPU cores to a model loading beside this one until the next call (0: none;
        ``proxy.engine.driver.CoreDriver.reserve_cores``)."""

    def cores_reserved(self) -> bool:
        """Every ``reserve_cores`` call so far applied by the engine (it steps with that count)."""

    def stats(self) -> EngineStats: ...
