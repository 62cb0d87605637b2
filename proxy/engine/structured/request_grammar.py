"""One request's grammar state: an xgrammar matcher that follows the request's output tokens."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import xgrammar as xgr

__all__ = ["RequestGrammar"]

logger = logging.getLogger(__name__)


class RequestGrammar:
    """One request's grammar state.

    Args:
        compiled: the compiled grammar (shared, read-only).
        stop_token_ids: tokens that end the output once the grammar is complete (the engine's EOS ids).
        extra_mask: int32 bitmask ANDed into every grammar mask (JSON: no raw control characters).
        stop_mask: int32 bitmask of the stop tokens (what a terminated grammar allows).
        offset: the output index of the grammar's first token (after the reasoning, see
            :class:`~proxy.engine.structured.ReasoningEnd`); earlier output tokens are never consumed.
    """

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        stop_token_ids: Sequence[int],
        extra_mask: torch.Tensor | None = None,
        stop_mask: torch.Tensor | None = None,
        offset: int = 0,
    ) -> None:
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        self.offset = offset
        self.stop_mask = stop_mask
        self.num_accepted = 0
        self.is_failed = False
        self.extra_mask = extra_mask

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Consume the output tokens from ``offset`` on not seen yet (those sampled since the last call)."""
        while self.offset + self.num_accepted < len(output_token_ids) and not self.is_failed:
            token = output_token_ids[self.offset + self.num_accepted]
            self.num_accepted += 1
            if self.matcher.is_terminated():
                continue
            if not self.matcher.accept_token(token):
                # Cannot happen for tokens sampled under the mask; keep serving, and say so.
                logger.warning("grammar rejected token %d; the request is no longer constrained", token)
                self.is_failed = True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, bit ``t % 32`` of word
        ``t // 32`` set when token ``t`` is allowed). A finished grammar allows only its stop tokens."""
        if self.is_failed:
            bitmask[row].fill_(-1)
            return
        if self.matcher.is_terminated():
            # The grammar ended and a stop token was taken, yet the request goes on (``ignore_eos``):
            # only stop tokens stay allowed.
            if self.stop_mask is not None:
                bitmask[row] = self.stop_mask
            else:
                bitmask[row].fill_(-1)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.extra_mask is not None:
            bitmask[row] &= self.extra_mask
