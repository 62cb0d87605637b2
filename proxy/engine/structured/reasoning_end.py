"""Where a constrained request's grammar starts: after the end of its reasoning (thinking models).

A thinking model writes free text, then the end-of-thinking marker (``</think>``: one special token,
or several plain tokens), then its answer; ``response_format`` and forced tool calls constrain the
answer only. vLLM's structured-output manager keeps ``reasoning_ended`` per request (initialised from
``is_reasoning_end(prompt_token_ids)``) and fills no bitmask and advances no matcher until the
reasoning parser reports the end; the matcher then consumes the tokens after the marker. This module
is that rule over token ids, set per request by :class:`~proxy.sampling.StructuredOutputParams`:

- ``reasoning_end_ids`` None: the grammar applies from output token 0 (no reasoning).
- ``starts_in_reasoning`` True (the prompt opened the thinking): the grammar waits; it applies from
  the token after the first occurrence of ``reasoning_end_ids`` in the output (the sequence matched
  whole, so a marker split over several tokens counts only once all of them are out).
- ``starts_in_reasoning`` False (the model may not think at all): output token 0 decides. It is
  sampled under the grammar's first mask with ``reasoning_start_ids[0]`` allowed too; if it is that
  token the output thinks and the grammar waits for the end marker as above, else the grammar
  applies from token 0 (that token included). Simple on purpose: a start marker is recognised by its
  first token only.

While the grammar waits the request has no mask row, so it samples exactly what the same request
without ``structured_outputs`` samples (same seed, same tokens). A marker that never comes leaves the
output unconstrained until ``max_tokens`` (``finish_reason`` ``"length"``) or EOS. The state follows
the output tokens (which survive preemption by recompute) and scans each new token once.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.sampling import StructuredOutputParams

__all__ = ["ReasoningEnd"]


class ReasoningEnd:
    """One constrained request's reasoning state: where in its output the grammar starts.

    Args:
        so: the request's structured output (its ``reasoning_end_ids``, ``starts_in_reasoning``,
            ``reasoning_start_ids``).

    Attributes:
        grammar_start: the output index of the grammar's first token once known; None while the
            reasoning lasts (or before output token 0 when the first token decides).
        open_token: the start-of-thinking token to allow beside the grammar's mask at output token 0
            (only while the first token decides), else None.
    """

    def __init__(self, so: StructuredOutputParams) -> None:
        self.end_ids: tuple[int, ...] = so.reasoning_end_ids or ()
        self.grammar_start: int | None = None
        self.open_token: int | None = None
        self._search_from = 0  # where the marker may begin (after a start token, if any)
        self._num_scanned = 0  # output tokens looked at so far
        if so.reasoning_end_ids is None:
            self.grammar_start = 0
        elif not so.starts_in_reasoning:
            if so.reasoning_start_ids:
                self.open_token = so.reasoning_start_ids[0]
            else:
                self.grammar_start = 0

    def update(self, output_token_ids: Sequence[int]) -> int | None:
        """Look at the output tokens not seen yet; return :attr:`grammar_start` (None: no mask now).

        Costs O(new tokens x marker length) per call. While ``open_token`` is set and no output token
        exists yet, returns 0 (the first token is sampled under the grammar's mask plus
        ``open_token``)."""
        if self.grammar_start is not None:
            return self.grammar_start
        num = len(output_token_ids)
        if self.open_token is not None:
            if num == 0:
                return 0
            if output_token_ids[0] != self.open_token:
                self.open_token = None
                self.grammar_start = 0
                return 0
            self.open_token = None
            self._search_from = self._num_scanned = 1
        end = self.end_ids
        width = len(end)
        first = max(self._search_from, self._num_scanned - width + 1)
        for i in range(first, num - width + 1):
            if output_token_ids[i] == end[0] and tuple(output_token_ids[i:i + width]) == end:
                self.grammar_start = i + width
                return self.grammar_start
        self._num_scanned = num
        return None
