""":class:`SchedulerOutput`: the work of one engine step, as the scheduler hands it to the model runner."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from proxy.engine.request import Request


@dataclass
class SchedulerOutput:
    """The work of one step, in batch order (decodes first, then prefill chunks).

    Attributes:
        requests: scheduled requests; each one's ``num_computed_tokens`` is still the value before
            this step (it is advanced by ``Scheduler.update``).
        num_new_tokens: tokens each request computes this step (1 for a decode, a chunk for prefill).
        sample_indices: indices into ``requests`` of those whose last scheduled token is the last
            token of their sequence, so the step samples a new token for them.
        num_decodes: the first ``num_decodes`` requests are decodes (one token each).
        num_encoder_tokens: the prefill-token cost of the images this step encodes
            (``proxy.engine.scheduler.images``; 0: none).
    """

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)
    num_decodes: int = 0
    num_encoder_tokens: int = 0

    @classmethod
    def from_scheduled(cls, scheduled: Mapping[Request, int]) -> SchedulerOutput:
        """The step of ``scheduled`` (request -> tokens it computes this step, in scheduling order).

        Entries of one token come first: decodes of the answer (a generated token), then prompt
        tokens (a prompt with only its last token left, a one-token chunk), each in scheduling order
        (a stable sort); then the other chunks, output tokens a preempted request recomputes before
        prompt chunks. The model runner attends the leading one-token entries as decode rows;
        ``num_decodes`` counts them.
        """
        out = cls()
        order = sorted(scheduled.items(), key=lambda item: (item[1] != 1, item[0].is_in_prompt))
        for index, (request, num_new) in enumerate(order):
            out.requests.append(request)
            out.num_new_tokens.append(num_new)
            if request.num_computed_tokens + num_new == request.num_tokens:
                out.sample_indices.append(index)
            if num_new == 1 and out.num_decodes == index:
                out.num_decodes += 1
        return out

    @property
    def total_num_tokens(self) -> int:
        """Tokens in the step's ragged batch."""
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        """True when nothing is scheduled."""
        return not self.requests
