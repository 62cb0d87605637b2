""":class:`Scheduler`: FCFS continuous batching over a ``BlockManager`` (no torch).

The policy (chunked prefill under a step budget, bounded prefill in decode steps, prefix caching,
preemption by recompute, the finish rule) is described in the package docstring
(``proxy.engine.scheduler``); :class:`~proxy.engine.scheduler.budget.StepBudget` holds the step
budget and the prefill bound, :func:`~proxy.engine.scheduler.finish.check_stop` the finish rule of a
sampled token, and :class:`~proxy.engine.scheduler.output.SchedulerOutput` is what a step hands to
the model runner.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence

from proxy.engine.block_manager import BlockManager
from proxy.engine.request import FinishReason, Request, RequestOutput, RequestStatus, TokenLogprob
from proxy.engine.scheduler.budget import StepBudget
from proxy.engine.scheduler.finish import check_stop
from proxy.engine.scheduler.output import SchedulerOutput
from proxy.engine.scheduler.step_cost import StepCostModel


class Scheduler:
    """FCFS continuous batching over a ``BlockManager``.

    Args:
        block_manager: the KV block pool.
        max_num_seqs: most running requests.
        max_num_batched_tokens: token budget of one step.
        max_model_len: longest prompt + output in tokens.
        eos_token_ids: ids that end a sequence unless ``ignore_eos``.
        long_prefill_token_threshold: in a step with decodes, the largest prefill chunk of one
            request (tokens); 0: no cap beyond the step budget.
        max_num_partial_prefills: in a step with decodes, the most requests whose prefill chunks
            join it (>= 1).
        step_cost: the measured bound on a decode step's prefill tokens (fed by
            ``step_cost.observe``); None: ``StepCostModel(0)``, off.

    Raises:
        ValueError: a count below its minimum.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int],
        long_prefill_token_threshold: int = 0,
        max_num_partial_prefills: int = 1_000_000,
        step_cost: StepCostModel | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_num_partial_prefills < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_num_partial_prefills must be >= 1")
        if long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.step_cost = step_cost or StepCostModel(0)
        self.max_num_partial_prefills = max_num_partial_prefills
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Outputs produced outside sampling (a request that cannot fit the KV pool), sent next update.
        self._pending_outputs: list[RequestOutput] = []
        self._watermark_blocks = max(1, block_manager.num_total_blocks // 100)

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

    def fail_requests(self, requests: Sequence[Request], message: str) -> list[RequestOutput]:
        """Finish live requests with ``finish_reason="error"`` and ``message``; free their blocks."""
        outputs = []
        for request in requests:
            if request.is_finished or request.request_id not in self.requests:
                continue
            self._remove(request)
            self._finish(request, "error", message)
            outputs.append(request.make_output([], None))
        return outputs

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

    # ---- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating their KV slots.

        Decodes first, then running requests mid-prefill, then waiting ones FCFS (each after its
        longest cached prefix); prefill beside decodes is bounded outside a burst (``StepBudget.for_step``).
        """
        budget = StepBudget.for_step(
            self.max_num_batched_tokens, self.long_prefill_token_threshold, self.max_num_partial_prefills,
            self.step_cost, self.waiting, self.max_num_seqs - len(self.running),
            sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1))
        scheduled: dict[Request, int] = {}
        preempted = False
        bm = self.block_manager
        for decode_pass in (True, False):
            i = 0
            while i < len(self.running) and budget.num_tokens_left > 0:
                request = self.running[i]
                i += 1
                if request in scheduled:
                    continue
                remaining = request.num_tokens - request.num_computed_tokens
                if (remaining == 1) is not decode_pass:
                    continue
                if decode_pass:
                    num_new = 1
                else:
                    num_new = budget.prefill_chunk(remaining)
                    if num_new == 0:
                        continue
                while not bm.allocate_slots(request, num_new):
                    if len(self.running) == 1:
                        # Alone and still out of blocks: the pool cannot hold this sequence.
                        self.running.pop()
                        self._finish(request, "length")
                        self._pending_outputs.append(request.make_output([], None))
                        break
                    victim = self.running.pop()
                    if victim in scheduled:
                        budget.give_back(scheduled.pop(victim),
                                         victim.num_computed_tokens + 1 == victim.num_tokens)
                    self._preempt(victim)
                    preempted = True
                    if victim is request:
                        break
                else:
                    scheduled[request] = num_new
                    budget.take(num_new, decode_pass)
        # Blocks filled by this step's running requests join the prefix cache only now, once no
        # more preemption can take back their slots (a preempted victim computes nothing).
        for request, num_new in scheduled.items():
            bm.cache_full_blocks(request, request.num_computed_tokens + num_new)
        if not preempted:
            self._admit_waiting(scheduled, budget)
        out = SchedulerOutput.from_scheduled(scheduled)
        now = time.monotonic()
        for request in out.requests:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        return out

    def _admit_waiting(self, scheduled: dict[Request, int], budget: StepBudget) -> None:
        bm = self.block_manager
        watermark = self._watermark_blocks
        while self.waiting and budget.num_tokens_left > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            cached = bm.find_cached_prefix(request) if not request.block_ids else []
            num_cached = len(cached) * bm.block_size
            remaining = request.num_tokens - request.num_computed_tokens - num_cached
            if remaining == 1:
                num_new = 1  # only the last token is left (a full cache hit): as cheap as a decode
            else:
                num_new = budget.prefill_chunk(remaining)
                if num_new == 0:
                    break
            total = request.num_computed_tokens + num_cached + num_new
            needed = bm.num_blocks_for(total) - len(request.block_ids) - len(cached)
            needed += bm.num_free_among(cached)
            if self.running and bm.num_free_blocks - needed < watermark:
                break
            if not bm.allocate_slots(request, num_new, cached):
                break
            if request.num_cached_tokens < 0:  # first scheduling: count the lookup
                request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
                if bm.enable_prefix_caching:
                    bm.record_query(request.num_prompt_tokens, request.num_cached_tokens)
            bm.cache_full_blocks(request, request.num_computed_tokens + num_new)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request] = num_new
            budget.take(num_new, num_new == 1)

    def update(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprob | None] | None = None,
    ) -> list[RequestOutput]:
        """Advance computed counts, append sampled tokens, finish requests, free their blocks.

        Args:
            scheduler_output: what ``schedule`` returned for this step.
            sampled_token_ids: one token per entry of ``scheduler_output.sample_indices``.
            logprobs: per sampled token, its ``TokenLogprob`` (None where not requested).

        Returns:
            one output per request that got a token or finished, in batch order.
        """
        outputs = self._pending_outputs
        self._pending_outputs = []
        requests = scheduler_output.requests
        for request, num_new in zip(requests, scheduler_output.num_new_tokens):
            request.num_computed_tokens += num_new
        now = time.monotonic()
        any_finished = False
        eos = self.eos_token_ids
        for k, index in enumerate(scheduler_output.sample_indices):
            request = requests[index]
            if request.is_finished:
                continue
            token = int(sampled_token_ids[k])
            request.append_token(token)
            if request.first_token_time is None:
                request.first_token_time = now
            reason = check_stop(request, token, eos, self.max_model_len)
            if reason is not None:
                self._finish(request, reason)
                any_finished = True
            lp = logprobs[k] if logprobs is not None else None
            outputs.append(request.make_output([token], [lp] if lp is not None else None))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        self.block_manager.commit()
        return outputs

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
