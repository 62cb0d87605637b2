"""The thinking budget of one request: when to force the end-of-thinking marker.

vLLM's ``thinking_token_budget`` (``ThinkingBudgetStateHolder``), llama.cpp's ``--reasoning-budget``
and Anthropic's ``thinking.budget_tokens`` all close the thinking at a number of tokens by forcing the
reasoning parser's end marker as the next tokens. The rule here, over token ids, set per request by
:class:`~proxy.sampling.ThinkingBudget`:

- **Where the thinking starts.** ``starts_in_reasoning`` (the prompt opened it): at output token 0.
  Otherwise only an output that begins with ``start_ids`` thinks, from the token after them (the
  reasoning parser honours the open tag only as the first text of the output); any other start
  means no thinking, and the request is never forced.
- **Counting.** Every output token after the start is a thinking token until the first whole
  occurrence of ``end_ids`` (the model's own close; a marker split over several tokens counts once
  all of them are out). From there on the request is free.
- **Forcing.** Once ``max_tokens`` thinking tokens are out without the close, the next
  ``len(end_ids)`` output tokens are ``end_ids[0]``, ``end_ids[1]``, ... whatever the model's
  distribution says (a forced token replaces the sampled one; the row's draw still happens, so
  nothing else in the batch sees a difference). The thinking then holds exactly ``max_tokens``
  tokens, and the output continues after the marker as the model writes it. A marker the model had
  begun (its first tokens of a multi-token marker at the budget's end) stays in the thinking; the
  whole marker follows.

``max_tokens`` and EOS still end the output first when they come first. The state follows the output
tokens (which survive preemption by recompute) and looks at each new token once.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.engine.request import Request
from proxy.sampling import ThinkingBudget

__all__ = ["ThinkingBudgetState", "ThinkingBudgets"]


class ThinkingBudgetState:
    """One request's thinking budget: which token, if any, is forced next.

    Args:
        budget: the request's :class:`~proxy.sampling.ThinkingBudget`.
    """

    def __init__(self, budget: ThinkingBudget) -> None:
        self.budget = budget
        self._start: int | None = 0 if budget.starts_in_reasoning else None  # first thinking token
        self._done = False  # the thinking ended (or never began): nothing more is forced
        self._num_scanned = 0  # output tokens searched for the end marker so far

    @property
    def is_done(self) -> bool:
        """The thinking ended (closed by the model or by force) or there is none: nothing is forced."""
        return self._done

    def forced_token(self, output_token_ids: Sequence[int]) -> int | None:
        """The token the next sampled position must be, or None (sample as usual).

        Args:
            output_token_ids: the request's output so far.

        Costs O(new tokens x marker length) per call.
        """
        if self._done:
            return None
        num = len(output_token_ids)
        budget = self.budget
        if self._start is None:
            width = len(budget.start_ids)
            if num < max(width, 1):
                return None
            if width == 0 or tuple(output_token_ids[:width]) != budget.start_ids:
                self._done = True
                return None
            self._start = self._num_scanned = width
        start = self._start
        end = budget.end_ids
        width = len(end)
        first = max(start, self._num_scanned - width + 1)
        for i in range(first, num - width + 1):
            if output_token_ids[i] == end[0] and tuple(output_token_ids[i:i + width]) == end:
                self._done = True
                return None
        self._num_scanned = num
        num_forced = num - start - budget.max_tokens
        if num_forced < 0:
            return None
        return end[num_forced]  # < width: the whole marker would have been found above


class ThinkingBudgets:
    """The live budget states of a sampler's requests, by request id (created at a request's first
    sampled token, dropped by :meth:`forget`)."""

    def __init__(self) -> None:
        self._states: dict[str, ThinkingBudgetState] = {}

    def forget(self, request_id: str) -> None:
        """Drop a finished request's state."""
        self._states.pop(request_id, None)

    def force(self, requests: Sequence[Request], token_ids: list[int]) -> None:
        """Replace, in place, ``token_ids[i]`` (the token sampled for ``requests[i]``) by the token its
        budget forces, where one does (:meth:`ThinkingBudgetState.forced_token`)."""
        for i, request in enumerate(requests):
            budget = request.params.thinking_budget
            if budget is None:
                continue
            state = self._states.get(request.request_id)
            if state is None:
                state = self._states[request.request_id] = ThinkingBudgetState(budget)
            if state.is_done:
                continue
            forced = state.forced_token(request.output_token_ids)
            if forced is not None:
                token_ids[i] = forced
