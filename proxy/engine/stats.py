"""Per-request Prometheus observations (TTFT, ITL, latency, finish reasons) from engine outputs.

Feeds :class:`proxy.metrics.Metrics` from the :class:`~proxy.engine.output.OutputProcessor`, which
owns one recorder and calls it for every engine output it routes (and for client aborts). Times are
``time.monotonic()`` seconds, the clock of ``RequestOutput`` timestamps.
TTFT is the engine's ``first_token_time - arrival_time``; inter-token latency is measured where
the outputs reach the event loop (what a client can see at best), as vLLM's frontend does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from proxy.engine.request import RequestOutput
from proxy.metrics import Metrics


@dataclass
class _Seen:
    arrival_time: float
    last_token_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    first_scheduled_time: float | None = None

    def queue_s(self) -> float | None:
        """Seconds from arrival to first scheduled; None while never scheduled."""
        scheduled = self.first_scheduled_time
        return None if scheduled is None else max(0.0, scheduled - self.arrival_time)


class MetricsRecorder:
    """Turns the outputs of each engine request into ``Metrics`` observations."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._seen: dict[str, _Seen] = {}

    def on_add(self, request_id: str, num_prompt_tokens: int) -> None:
        """A request was handed to the engine: from now on it is counted once it ends, whether it
        finishes, is aborted while still queued, or is aborted mid-generation."""
        self._seen[request_id] = _Seen(time.monotonic(), None, num_prompt_tokens, 0)

    def forget(self, request_id: str) -> None:
        """Drop a request without counting it (refused before it ran: counted as rejected)."""
        self._seen.pop(request_id, None)

    def on_output(self, output: RequestOutput, finish_reason: str | None) -> None:
        """One engine output and the finish reason output processing decided for it (None: running)."""
        now = time.monotonic()
        seen = self._seen.get(output.request_id)
        if seen is None:  # not handed to the engine through on_add (or already counted)
            return
        if output.arrival_time:
            seen.arrival_time = output.arrival_time  # the engine's own arrival, as TTFT measures it
        if output.first_scheduled_time is not None:
            seen.first_scheduled_time = output.first_scheduled_time
        num_new = len(output.new_token_ids)
        if num_new:
            if seen.last_token_time is None:
                first = output.first_token_time if output.first_token_time is not None else now
                self.metrics.observe_first_token(max(0.0, first - seen.arrival_time))
                if num_new > 1:
                    self.metrics.observe_inter_token(0.0, num_new - 1)
            else:
                self.metrics.observe_inter_token((now - seen.last_token_time) / num_new, num_new)
            seen.last_token_time = now
        seen.num_output_tokens = output.num_output_tokens or seen.num_output_tokens + num_new
        seen.num_prompt_tokens = output.num_prompt_tokens or seen.num_prompt_tokens
        if finish_reason is None:
            return
        del self._seen[output.request_id]
        self.metrics.observe_finished(
            finish_reason,
            e2e_s=max(0.0, now - seen.arrival_time),
            queue_s=seen.queue_s(),
            num_prompt_tokens=seen.num_prompt_tokens,
            num_generation_tokens=seen.num_output_tokens,
        )

    def on_abort(self, request_id: str) -> None:
        """The client went away (or the shutdown cut the request): count it as ``abort``, with its
        queue time when it was scheduled (a request aborted while queued has none)."""
        seen = self._seen.pop(request_id, None)
        if seen is None:
            return
        self.metrics.observe_finished("abort", e2e_s=max(0.0, time.monotonic() - seen.arrival_time),
                                      queue_s=seen.queue_s(), num_prompt_tokens=seen.num_prompt_tokens,
                                      num_generation_tokens=seen.num_output_tokens)
