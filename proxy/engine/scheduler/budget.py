""":class:`StepBudget`: the tokens a step has left and the prefill that may still join it, from a
:class:`StepState` of the queues (like vLLM's ``SchedulingBudget``, it counts what the step holds,
so a preempted request's tokens can be given back)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proxy.engine.scheduler.config import SchedulerConfig
from proxy.engine.scheduler.step_cost import StepCostModel

PrefillTokenLimit = Callable[[int, int], int | None]
"""``(num_decodes, num_waiting) -> most prefill tokens of the step`` (None: no limit), as
:meth:`StepCostModel.prefill_token_limit`."""


@dataclass(frozen=True)
class StepState:
    """The queues as a step starts being scheduled.

    Attributes:
        num_decodes: running requests that need exactly one token.
        num_waiting: requests in the waiting queue.
        num_free_seqs: requests ``max_num_seqs`` leaves room for (``max_num_seqs - running``).
    """

    num_decodes: int
    num_waiting: int
    num_free_seqs: int

    @property
    def num_startable(self) -> int:
        """Waiting requests that could start this step: as many as there is room for."""
        return min(self.num_waiting, self.num_free_seqs)


@dataclass
class StepBudget:
    """The token budget of one step being scheduled, with its decode and prefill counts.

    Attributes:
        num_tokens_left: tokens the step may still take (starts at ``max_num_batched_tokens``).
        long_prefill_token_threshold: in a step with decodes, the largest prefill chunk of one
            request (tokens); 0: no cap beyond the step budget.
        max_num_partial_prefills: in a step with decodes, the most requests whose prefill chunks
            join it.
        prefill_token_limit: in a step with decodes, the most prefill tokens in all for its
            decodes and waiting requests (None from it: no limit); None: no such limit.
        max_padded_prefill_rows: the most prefill query rows once every chunk is padded to the
            longest (chunks x longest chunk); None: no cap.
        num_decodes: one-token entries taken so far.
        num_prefills: prefill chunks taken so far.
        num_prefill_tokens: tokens of those chunks, with their images' encoder cost.
        longest_prefill_chunk: the longest of them (tokens; kept when a chunk is given back, so the
            cap stays on the safe side).
    """

    num_tokens_left: int
    long_prefill_token_threshold: int
    max_num_partial_prefills: int
    prefill_token_limit: PrefillTokenLimit | None = None
    max_padded_prefill_rows: int | None = None
    num_decodes: int = 0
    num_prefills: int = 0
    num_prefill_tokens: int = 0
    longest_prefill_chunk: int = 0

    @classmethod
    def for_step(cls, config: SchedulerConfig, step_cost: StepCostModel, state: StepState) -> StepBudget:
        """The budget of the step a scheduler is choosing.

        The rule: padded prefill rows are capped at twice the token budget (the attention of two
        whole chunks; the model runner pads chunks to the longest, ``B_p x Q_p`` rows). A burst
        (``config.max_prefill_step_ratio > 0`` and ``state.num_startable > state.num_decodes``)
        takes the whole token budget, as a step without decodes does. Any other step is bounded by
        the token knobs and ``step_cost``'s measured limit.
        """
        tokens = config.max_num_batched_tokens
        rows = 2 * tokens
        if config.max_prefill_step_ratio > 0 and state.num_startable > state.num_decodes:
            return cls(tokens, 0, tokens, max_padded_prefill_rows=rows)
        return cls(tokens, config.long_prefill_token_threshold, config.max_num_partial_prefills,
                   step_cost.prefill_token_limit, max_padded_prefill_rows=rows)

    def prefill_chunk(self, remaining: int, num_waiting: int = 0,
                      pieces: Sequence[tuple[int, int]] = ()) -> int:
        """Tokens of a prefill with ``remaining`` tokens to compute that may join this step (0: none),
        with ``num_waiting`` requests in the waiting queue now (the one asking included).

        ``pieces``: the pieces of its images not encoded yet that the chunk may reach, in prompt
        order, as ``(tokens before the piece's first placeholder in the chunk, its encoder cost in
        prefill tokens)`` (``proxy.engine.scheduler.images``); a piece is encoded in the step whose
        chunk reaches it. In a step with decodes that cost counts against the same bounds as its
        tokens, piece by piece: the chunk takes a piece where the bounds leave room for its cost, the
        tokens before it and one of its placeholders, and stops before the first piece they do not;
        a chunk that starts at such a piece takes it alone (the first prefill of the step, one token),
        as a chunk of one dense call's rows is computed whole. The chunk pays the cost of the pieces
        it reaches (``images.charged``).
        """
        num_new = min(remaining, self.num_tokens_left)
        if self.num_decodes:
            if self.num_prefills >= self.max_num_partial_prefills:
                return 0
            allowed = self._time_allowance(num_waiting)
            if allowed is not None:
                for at, cost in pieces:
                    if at >= num_new:
                        break
                    if allowed - cost > at:
                        allowed -= cost
                        continue
                    if at > 0:
                        allowed = min(allowed, at)
                    else:
                        allowed = max(1, allowed - cost) if self.num_prefills == 0 else 0
                    break
                num_new = max(0, min(num_new, allowed))
        rows = self.max_padded_prefill_rows
        if rows is not None and num_new > 0:
            chunks = self.num_prefills + 1
            if chunks * self.longest_prefill_chunk > rows:
                return 0
            num_new = min(num_new, rows // chunks)
        return num_new

    def _time_allowance(self, num_waiting: int) -> int | None:
        """In a step with decodes, the most prefill cost one more chunk may add: its
        ``long_prefill_token_threshold`` and what the measured limit leaves (None: neither bounds it)."""
        caps = [self.long_prefill_token_threshold] if self.long_prefill_token_threshold > 0 else []
        limit = None if self.prefill_token_limit is None else self.prefill_token_limit(
            self.num_decodes, num_waiting)
        if limit is not None:
            caps.append(limit - self.num_prefill_tokens)
        return min(caps) if caps else None

    def take(self, num_new: int, is_decode: bool, encoder_cost: int = 0) -> None:
        """Count an entry of ``num_new`` tokens joining the step (a decode or a prefill chunk), whose
        image pieces' encoding costs ``encoder_cost`` prefill tokens (:meth:`prefill_chunk`)."""
        self.num_tokens_left -= num_new
        self.num_prefill_tokens += encoder_cost
        if is_decode:
            self.num_decodes += 1
        else:
            self.num_prefills += 1
            self.num_prefill_tokens += num_new
            self.longest_prefill_chunk = max(self.longest_prefill_chunk, num_new)

    def give_back(self, num_new: int, is_decode: bool, encoder_cost: int = 0) -> None:
        """Undo :meth:`take` for an entry that leaves the step (its request was preempted)."""
        self.num_tokens_left += num_new
        self.num_prefill_tokens -= encoder_cost
        if is_decode:
            self.num_decodes -= 1
        else:
            self.num_prefills -= 1
            self.num_prefill_tokens -= num_new
