""":class:`RequestQueues`: the scheduler's queues of requests and every way a request ends outside
sampling (abort, failure, a preemption's return to the queue); :class:`~proxy.engine.scheduler.Scheduler`
adds the steps (no torch)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from proxy.engine.block_manager import BlockManager
from proxy.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from proxy.engine.scheduler.config import SchedulerConfig
from proxy.engine.scheduler.output import SchedulerOutput


class RequestQueues:
    """The waiting queue and running batch of requests over a ``BlockManager``.

    Args:
        block_manager: the KV block pool.
        config: the scheduler's knobs.
    """

    def __init__(self, block_manager: BlockManager, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Outputs produced outside sampling (a request that cannot fit the KV pool), sent next update.
        self._pending_outputs: list[RequestOutput] = []

    # ---- queue management -------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be (re)scheduled."""
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running, or outputs are pending."""
        return bool(self.waiting or self.running or self._pending_outputs)

    def add_request(self, request: Request) -> None:
        """Queue a new request (FCFS).

        Raises:
            ValueError: duplicate request id.
        """
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a live request with ``finish_reason="abort"`` and free its blocks.

        Returns:
            its final output, or None when the id is unknown or already finished (idempotent).
        """
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._remove(request)
        return self._finish(request, "abort").make_output([], None)

    def fail_requests(self, requests: Sequence[Request], message: str,
                      code: str | None = None) -> list[RequestOutput]:
        """Finish live requests with ``finish_reason="error"``, ``message`` and error ``code``; free
        their blocks."""
        outputs = []
        for request in requests:
            if request.is_finished or request.request_id not in self.requests:
                continue
            self._remove(request)
            self._finish(request, "error", message).error_code = code
            outputs.append(request.make_output([], None))
        return outputs

    def fail_images(self, failed: Mapping[Request, str], code: str) -> list[RequestOutput]:
        """Requests of the step just run whose images the vision encoder could not encode (their
        image rows ran as zeros): unregister the blocks the step registered for them from the block
        of their first placeholder on (those before it hold text alone, computed right), then finish
        each with "error", its message and ``code``. Call before :meth:`update` (which skips them)."""
        bs = self.block_manager.block_size
        for request in failed:
            first = request.images.token_positions[0] if request.images is not None else 0
            self.block_manager.uncache_uncommitted(request.block_ids[first // bs:])
        return [out for request, message in failed.items()
                for out in self.fail_requests([request], message, code)]

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Fail every live request (engine shutdown or death)."""
        return self.fail_requests(list(self.requests.values()), message)

    def _remove(self, request: Request) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> Request:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        self.block_manager.free(request)
        self.requests.pop(request.request_id, None)
        return request

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def fail_step(self, scheduler_output: SchedulerOutput, message: str) -> list[RequestOutput]:
        """The step's forward pass or sampling raised: fail its requests (``finish_reason="error"``).

        The blocks this step registered in the prefix cache may be half-written: they are
        unregistered before anything else can look them up. Outputs pending from ``schedule`` are
        returned first.
        """
        self.block_manager.uncache_uncommitted()
        outputs = self._pending_outputs
        self._pending_outputs = []
        return outputs + self.fail_requests(scheduler_output.requests, message)
