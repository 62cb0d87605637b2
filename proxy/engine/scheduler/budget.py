""":class:`StepBudget`: how many tokens a step has left, and how much prefill may still join it.

The bound on prefill in a step that carries decodes (``long_prefill_token_threshold`` tokens per
prompt, ``max_num_partial_prefills`` prompts, vLLM's knobs; and the measured limit of
:class:`~proxy.engine.scheduler.step_cost.StepCostModel` on all its prefill tokens) is the package
docstring's second policy item; this class is its one source, and :meth:`StepBudget.for_step` lifts
it for a burst of arrivals (package docstring). Like vLLM's ``SchedulingBudget``, it also counts
what the step holds so far, so a preempted victim's tokens can be given back.

The model runner pads a step's prefill chunks to the longest one (``B_p x Q_p`` query rows, see
``proxy.engine.attention.metadata``), so a budget also caps those padded rows
(``max_padded_prefill_rows``; ``for_step`` allows twice the token budget, the attention of two whole
chunks): a 1700-token chunk beside fifteen 20-token ones would otherwise make the step attend 16 x
1700 query rows, ~14x the real ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from dataclasses import dataclass

from proxy.engine.scheduler.step_cost import StepCostModel


@dataclass
class StepBudget:
    """The token budget of one step being scheduled, with its decode and prefill counts.

    Attributes:
        num_tokens_left: tokens the step may still take (starts at ``max_num_batched_tokens``).
        long_prefill_token_threshold: in a step with decodes, the largest prefill chunk of one
            request (tokens); 0: no cap beyond the step budget.
        max_num_partial_prefills: in a step with decodes, the most requests whose prefill chunks
            join it.
        prefill_token_limit: in a step with decodes, the most prefill tokens in all for a number
            of decodes (None from it: no limit); :meth:`StepCostModel.prefill_token_limit`.
        max_padded_prefill_rows: the most prefill query rows once every chunk is padded to the
            longest (chunks x longest chunk); None: no cap.
        num_decodes: one-token entries taken so far.
        num_prefills: prefill chunks taken so far.
        num_prefill_tokens: tokens of those chunks.
        longest_prefill_chunk: the longest of them (tokens; kept when a chunk is given back, so the
            cap stays on the safe side).
    """

    num_tokens_left: int
    long_prefill_token_threshold: int
    max_num_partial_prefills: int
    prefill_token_limit: Callable[[int], int | None] | None = None
    max_padded_prefill_rows: int | None = None
    num_decodes: int = 0
    num_prefills: int = 0
    num_prefill_tokens: int = 0
    longest_prefill_chunk: int = 0

    @classmethod
    def for_step(cls, max_num_batched_tokens: int, long_prefill_token_threshold: int,
                 max_num_partial_prefills: int, step_cost: StepCostModel, waiting: Sized,
                 num_free_seqs: int, num_decodes: int) -> StepBudget:
        """The budget of the step a scheduler is choosing (package docstring).

        A burst of arrivals, where the measured bound is on (``step_cost.max_ratio > 0``) and more
        of the ``waiting`` requests than ``num_decodes`` can start (``num_free_seqs``, the room
        ``max_num_seqs`` leaves: with the batch full nobody's first token would come sooner), takes
        the whole token budget as a step without decodes does; any other step is bounded by the
        token knobs and the measured limit (``len(waiting)`` read as admissions go). Padded prefill
        rows are capped at twice the token budget (module docstring).
        """
        tokens = max_num_batched_tokens
        rows = 2 * tokens
        if step_cost.max_ratio > 0 and min(len(waiting), num_free_seqs) > num_decodes:
            return cls(tokens, 0, tokens, max_padded_prefill_rows=rows)
        return cls(tokens, long_prefill_token_threshold, max_num_partial_prefills,
                   lambda n: step_cost.prefill_token_limit(n, len(waiting)), max_padded_prefill_rows=rows)

    def prefill_chunk(self, remaining: int) -> int:
        """Tokens of a prefill with ``remaining`` tokens to compute that may join this step (0: none)."""
        num_new = min(remaining, self.num_tokens_left)
        if self.num_decodes:
            if self.num_prefills >= self.max_num_partial_prefills:
                return 0
            if self.long_prefill_token_threshold > 0:
                num_new = min(num_new, self.long_prefill_token_threshold)
            limit = self.prefill_token_limit(self.num_decodes) if self.prefill_token_limit else None
            if limit is not None:
                num_new = max(0, min(num_new, limit - self.num_prefill_tokens))
        rows = self.max_padded_prefill_rows
        if rows is not None and num_new > 0:
            chunks = self.num_prefills + 1
            if chunks * self.longest_prefill_chunk > rows:
                return 0
            num_new = min(num_new, rows // chunks)
        return num_new

    def take(self, num_new: int, is_decode: bool) -> None:
        """Count an entry of ``num_new`` tokens joining the step (a decode or a prefill chunk)."""
        self.num_tokens_left -= num_new
        if is_decode:
            self.num_decodes += 1
        else:
            self.num_prefills += 1
            self.num_prefill_tokens += num_new
            self.longest_prefill_chunk = max(self.longest_prefill_chunk, num_new)

    def give_back(self, num_new: int, is_decode: bool) -> None:
        """Undo :meth:`take` for an entry that leaves the step (its request was preempted)."""
        self.num_tokens_left += num_new
        if is_decode:
            self.num_decodes -= 1
        else:
            self.num_prefills -= 1
            self.num_prefill_tokens -= num_new
