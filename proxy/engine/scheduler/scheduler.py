""":class:`Scheduler`: FCFS continuous batching over a ``BlockManager`` (no torch).

The policy is the package docstring's (``proxy.engine.scheduler``), its knobs
:class:`~proxy.engine.scheduler.config.SchedulerConfig`'s.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

from proxy.engine.block_manager import BlockManager
from proxy.engine.request import Request, RequestOutput, RequestStatus, TokenLogprob
from proxy.engine.scheduler.budget import StepBudget, StepState
from proxy.engine.scheduler.config import SchedulerConfig
from proxy.engine.scheduler.finish import check_stop
from proxy.engine.scheduler.images import EncoderCost, charged, no_encoder, pieces_ahead
from proxy.engine.scheduler.output import SchedulerOutput
from proxy.engine.scheduler.queues import RequestQueues
from proxy.engine.scheduler.step_cost import StepCostModel


class Scheduler(RequestQueues):
    """FCFS continuous batching over a ``BlockManager`` (the queues and how requests end:
    :class:`~proxy.engine.scheduler.queues.RequestQueues`).

    Args:
        block_manager: the KV block pool.
        config: the scheduler's knobs.
        eos_token_ids: ids that end a sequence unless ``ignore_eos``.

    Attributes:
        step_cost: the measured bound's step-time model (``StepCostModel.from_config``; the engine
            feeds it ``observe``).
        encoder_cost: the prefill-token cost of encoding a piece of a request's images now
            (``proxy.engine.scheduler.images``; the engine sets its image encoder's).
        whole_image_blocks: no prompt chunk ends inside an image block
            (``PromptImages.chunk_end_outside_blocks``: cut back before the block, or run on to its
            end, past the step budget, when the chunk starts in it), for a model whose image tokens
            attend to each other both ways during prefill (Gemma 3: a block's first rows see its last
            keys, so they must be in the same step); the engine sets it for such a model.
    """

    def __init__(self, block_manager: BlockManager, config: SchedulerConfig,
                 eos_token_ids: Iterable[int]) -> None:
        super().__init__(block_manager, config)
        self.step_cost = StepCostModel.from_config(config)
        self.encoder_cost: EncoderCost = no_encoder
        self.whole_image_blocks = False
        self._encoder: dict[Request, int] = {}  # this step's requests whose image pieces it encodes: cost
        self.eos_token_ids = frozenset(eos_token_ids)
        self._watermark_blocks = config.watermark_blocks(block_manager.num_total_blocks)

    # ---- one step: running decodes, running prefills, then waiting requests (vLLM's order) --------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating their KV slots.

        Returns:
            the step's work; its requests in scheduling order.
        """
        budget = StepBudget.for_step(self.config, self.step_cost, StepState(
            num_decodes=sum(1 for r in self.running if r.is_decoding), num_waiting=len(self.waiting),
            num_free_seqs=self.config.max_num_seqs - len(self.running)))
        scheduled: dict[Request, int] = {}
        self._encoder = {}
        num_preemptions = self.num_preemptions
        self._schedule_running_decodes(scheduled, budget)
        self._schedule_running_prefills(scheduled, budget)
        # Blocks filled by this step's running requests join the prefix cache only now, once no
        # more preemption can take back their slots (a preempted victim computes nothing).
        for request, num_new in scheduled.items():
            self.block_manager.cache_full_blocks(request, request.num_computed_tokens + num_new)
        if self.num_preemptions == num_preemptions:  # no request is admitted in a step that preempted
            self._admit_waiting(scheduled, budget)
        out = SchedulerOutput.from_scheduled(scheduled)
        out.num_encoder_tokens = sum(self._encoder.values())
        now = time.monotonic()
        for request in out.requests:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        return out

    def _running_in_order(self, budget: StepBudget) -> Iterator[Request]:
        """The running requests, oldest first, while the step has tokens left (preemption shortens
        the list from its end as it goes)."""
        i = 0
        while i < len(self.running) and budget.num_tokens_left > 0:
            yield self.running[i]
            i += 1

    def _schedule_running_decodes(self, scheduled: dict[Request, int], budget: StepBudget) -> None:
        """Phase 1: one token for each running request that needs exactly one."""
        for request in self._running_in_order(budget):
            if request.is_decoding:
                self._schedule_running(request, 1, scheduled, budget)

    def _schedule_running_prefills(self, scheduled: dict[Request, int], budget: StepBudget) -> None:
        """Phase 2: the next chunk of each running request mid-prefill, as the budget allows."""
        for request in self._running_in_order(budget):
            if not request.is_decoding:
                limit = self.chunk_limit(request, request.num_computed_tokens, scheduled)
                num_new, encoder = self._prefill_chunk(request, request.num_computed_tokens, limit, budget)
                if num_new:
                    self._schedule_running(request, num_new, scheduled, budget, encoder)

    def _prefill_chunk(self, request: Request, num_computed: int, remaining: int,
                       budget: StepBudget) -> tuple[int, int]:
        """``(tokens, encoder cost)`` of the prefill chunk of ``request`` from ``num_computed`` this
        step may take (``StepBudget.prefill_chunk``; the cost of the image pieces it reaches,
        ``proxy.engine.scheduler.images``)."""
        limit = min(remaining, budget.num_tokens_left)
        pieces = pieces_ahead(request, num_computed, limit, self.encoder_cost)
        num_new = budget.prefill_chunk(remaining, len(self.waiting), pieces)
        if num_new and self.whole_image_blocks and request.images is not None:
            num_new = request.images.chunk_end_outside_blocks(num_computed, num_new)
        return num_new, charged(pieces, num_new)

    def _schedule_running(self, request: Request, num_new: int, scheduled: dict[Request, int],
                          budget: StepBudget, encoder: int = 0) -> None:
        """Allocate ``num_new`` slots for a running request, preempting the most recently admitted
        running requests (it included, last) until they fit; alone and still out of blocks, the
        request finishes with "length" (the pool cannot hold it)."""
        while not self.block_manager.allocate_slots(request, num_new):
            if len(self.running) == 1:
                self.running.pop()
                self._finish(request, "length")
                self._pending_outputs.append(request.make_output([], None))
                return
            victim = self.running.pop()
            if victim in scheduled:
                budget.give_back(scheduled.pop(victim), victim.is_decoding, self._encoder.pop(victim, 0))
            self._preempt(victim)
            if victim is request:
                return
        scheduled[request] = num_new
        budget.take(num_new, request.is_decoding, encoder)
        if encoder:
            self._encoder[request] = encoder

    def chunk_limit(self, request: Request, num_computed: int, scheduled: dict[Request, int]) -> int:
        """The most tokens ``request`` may compute this step, ``num_computed`` of its tokens having
        K/V: all the rest; with ``config.outputs_on_decode_path``, up to its prompt's end while in
        it, past it as many output tokens as keep the step's output-token rows (``scheduled``'s
        requests past their prompts) within ``max_num_seqs`` (0: none this step)."""
        remaining = request.num_tokens - num_computed
        if not self.config.outputs_on_decode_path:
            return remaining
        if num_computed < request.num_prompt_tokens:
            return request.num_prompt_tokens - num_computed
        rows = sum(n for r, n in scheduled.items() if not r.is_in_prompt)
        return min(remaining, max(0, self.config.max_num_seqs - rows))

    def _admit_waiting(self, scheduled: dict[Request, int], budget: StepBudget) -> None:
        """Phase 3: start waiting requests FCFS, each after its longest cached prefix, until one
        does not fit the budget, ``max_num_seqs`` or the KV pool (less the watermark while others run)."""
        bm = self.block_manager
        while self.waiting and budget.num_tokens_left > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = bm.find_cached_prefix(request) if not request.block_ids else []
            num_cached = len(cached) * bm.block_size
            remaining = self.chunk_limit(request, request.num_computed_tokens + num_cached, scheduled)
            if remaining == 0:
                break
            start = request.num_computed_tokens + num_cached
            # only the last token left (a full cache hit): as cheap as a decode
            num_new, encoder = (1, 0) if remaining == 1 else self._prefill_chunk(request, start, remaining,
                                                                                 budget)
            if num_new == 0:
                break
            needed = bm.num_blocks_for(request.num_computed_tokens + num_cached + num_new)
            needed += bm.num_free_among(cached) - len(request.block_ids) - len(cached)
            if self.running and bm.num_free_blocks - needed < self._watermark_blocks:
                break
            if not bm.allocate_slots(request, num_new, cached):
                break
            self._start(request, num_cached, num_new)
            scheduled[request] = num_new
            budget.take(num_new, num_new == 1 and not encoder, encoder)
            if encoder:
                self._encoder[request] = encoder

    def _start(self, request: Request, num_cached: int, num_new: int) -> None:
        """Move the head of the waiting queue into the running batch (its slots allocated)."""
        bm = self.block_manager
        if request.num_cached_tokens < 0:  # first scheduling: count the lookup
            request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
            if bm.enable_prefix_caching:
                bm.record_query(request.num_prompt_tokens, request.num_cached_tokens)
        bm.cache_full_blocks(request, request.num_computed_tokens + num_new)
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        self.running.append(request)

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
            reason = check_stop(request, token, eos, self.config.max_model_len)
            if reason is not None:
                self._finish(request, reason)
                any_finished = True
            lp = logprobs[k] if logprobs is not None else None
            outputs.append(request.make_output([token], [lp] if lp is not None else None))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        self.block_manager.commit()
        return outputs
