"""Output processing: engine outputs -> detokenized, stop-checked text in per-request mailboxes.

Runs on the event loop, in the API process, whatever runs the engine core (vLLM's
``OutputProcessor``, owned by its ``AsyncLLM``; here owned by
:class:`~proxy.engine.client.AsyncEngineClient`).
For each :class:`~proxy.engine.request.RequestOutput` of a step it feeds the new token ids to the
hot path's incremental detokenizer and stop checker, and puts the text that is safe to show into
the request's :class:`~proxy.engine.mailbox.Mailbox`.

A stop-string match finishes the choice with ``finish_reason="stop"``; the request id is returned
to the caller, which aborts it in the engine (vLLM does the same: stop strings are checked on
detokenized text, outside the engine core). Metrics are recorded here, through one
:class:`~proxy.engine.stats.MetricsRecorder`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from proxy.engine.mailbox import Mailbox
from proxy.engine.request import RequestOutput
from proxy.engine.stats import MetricsRecorder
from proxy.protocol import LOGPROB_FLOOR, LogprobEntry
from proxy.reasoning import ReasoningParser, get_reasoning_parser
from proxy.sampling import SamplingParams


class Detokenizer(Protocol):
    def feed(self, ids: Sequence[int]) -> str: ...
    def flush(self) -> str: ...


class StopCheckerLike(Protocol):
    @property
    def matched_index(self) -> int: ...

    def feed(self, text: str) -> tuple[str, int]: ...
    def flush(self) -> str: ...


class TokenizerLike(Protocol):
    """The part of :class:`proxy.tokenizer.Tokenizer` output processing uses."""

    def new_detokenizer(self, keep_special_ids: frozenset[int] = ...) -> Detokenizer: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def token_text(self, token_id: int) -> str: ...


@dataclass
class _Tracked:
    mailbox: Mailbox
    index: int
    params: SamplingParams
    detokenizer: Detokenizer
    stop_checker: StopCheckerLike | None
    reasoning: ReasoningParser | None = None  # counts the tokens generated inside the thinking


class OutputProcessor:
    """Routes engine outputs to the mailboxes of their HTTP requests (runs on the event loop).

    Args:
        tokenizer: gives ``new_detokenizer()``, ``token_text`` and ``token_bytes``.
        recorder: Prometheus observations (TTFT, ITL, finish reasons); None: none.
        stop_checker_factory: builds a stop checker for a tuple of stop strings; default: the
            hot path's ``StopChecker``.
    """

    def __init__(self, tokenizer: TokenizerLike, recorder: MetricsRecorder | None = None,
                 stop_checker_factory: Callable[[Sequence[str]], StopCheckerLike] | None = None) -> None:
        if stop_checker_factory is None:
            from proxy.hotpath import StopChecker

            stop_checker_factory = StopChecker
        self._tokenizer = tokenizer
        self._recorder = recorder
        self._new_stop_checker = stop_checker_factory
        self._requests: dict[str, _Tracked] = {}

    @property
    def num_tracked(self) -> int:
        """Engine requests whose outputs are still expected."""
        return len(self._requests)

    def add(self, request_id: str, mailbox: Mailbox, index: int, params: SamplingParams,
            num_prompt_tokens: int = 0) -> None:
        """Start tracking engine request ``request_id`` (a prompt of ``num_prompt_tokens``) as choice
        ``index`` of ``mailbox``; the metrics count it once it ends, however it ends."""
        stop = self._new_stop_checker(params.stop) if params.stop else None
        detokenizer = (self._tokenizer.new_detokenizer(params.keep_special_ids) if params.keep_special_ids
                       else self._tokenizer.new_detokenizer())
        reasoning = None
        if params.reasoning_parser is not None:
            reasoning = get_reasoning_parser(params.reasoning_parser, in_reasoning=params.starts_in_reasoning)
            mailbox.num_reasoning_tokens = mailbox.num_reasoning_tokens or 0
        self._requests[request_id] = _Tracked(mailbox, index, params, detokenizer, stop, reasoning)
        if self._recorder is not None:
            self._recorder.on_add(request_id, num_prompt_tokens)

    def abort(self, request_id: str, *, observe: bool = True) -> bool:
        """Stop tracking a request (its response closed; idempotent). A request still tracked is
        counted as ``abort`` in the metrics (not counted with ``observe=False``: refused before it
        ran); returns whether it was tracked."""
        if self._requests.pop(request_id, None) is None:
            return False
        if self._recorder is not None:
            if observe:
                self._recorder.on_abort(request_id)
            else:
                self._recorder.forget(request_id)
        return True

    def fail_all(self, message: str, code: str = "server_shutdown") -> list[str]:
        """End every tracked request now: its mailbox fails with ``message``/``code``.

        Used when the shutdown grace period ends. The requests stay tracked until their response
        closes them (:meth:`abort`), so the metrics count them as aborted.

        Returns:
            the ids of the requests that were still running (the caller aborts them in the engine).
        """
        ended = [rid for rid, t in self._requests.items() if t.mailbox.error is None]
        for tracked in self._requests.values():
            tracked.mailbox.fail(message, code)
        return ended

    def _entries(self, output: RequestOutput) -> list[LogprobEntry]:
        tok = self._tokenizer
        entries = []
        for lp in output.new_logprobs or ():
            top = tuple(
                (tok.token_text(t), max(float(v), LOGPROB_FLOOR), tok.token_bytes(t)) for t, v in lp.top
            )
            entries.append(
                LogprobEntry(lp.token_id, tok.token_text(lp.token_id), tok.token_bytes(lp.token_id),
                             max(float(lp.logprob), LOGPROB_FLOOR), top)
            )
        return entries

    def process_outputs(self, outputs: Sequence[RequestOutput]) -> list[str]:
        """Handle all outputs of one engine step.

        Returns:
            request ids that a stop string finished while the engine still runs them: the caller
            aborts them in the engine (vLLM's ``reqs_to_abort``).
        """
        to_abort = []
        for output in outputs:
            if self._process(output):
                to_abort.append(output.request_id)
        return to_abort

    def _observe(self, output: RequestOutput, finish_reason: str | None) -> None:
        if self._recorder is not None:
            self._recorder.on_output(output, finish_reason)

    @staticmethod
    def _count_reasoning(tracked: _Tracked, ids: Sequence[int], text: str) -> None:
        """Count ``ids`` as reasoning tokens when the choice is inside its thinking before their
        text (as the API's parser sees it, after the stop checker) is read: the closing tag's
        tokens count, an EOS does not. Per engine step, so the count does not depend on how the
        consumer's deltas were coalesced (stream == non-stream)."""
        parser = tracked.reasoning
        if parser is None:
            return
        if parser.in_reasoning and tracked.mailbox.num_reasoning_tokens is not None:
            tracked.mailbox.num_reasoning_tokens += len(ids)
        if text:
            parser.feed(text)

    def _process(self, output: RequestOutput) -> bool:
        """One output; True when the engine must abort the request (a stop string matched)."""
        tracked = self._requests.get(output.request_id)
        if tracked is None:
            return False
        mailbox, index = tracked.mailbox, tracked.index
        if index == 0 and output.num_cached_tokens > mailbox.num_cached_tokens:
            mailbox.num_cached_tokens = output.num_cached_tokens
        entries = self._entries(output) if tracked.params.logprobs else []
        finished = output.finished
        all_ids = output.new_token_ids
        ids = all_ids
        if finished and output.stop_reason is not None and ids and ids[-1] == output.stop_reason:
            ids = ids[:-1]  # an EOS / stop_token_ids token ends the text and is not part of it
            if entries:
                e = entries[-1]
                entries[-1] = LogprobEntry(e.token_id, e.token, b"", e.logprob, e.top)
        text = tracked.detokenizer.feed(ids) if ids else ""
        if finished:
            text += tracked.detokenizer.flush()
        if tracked.stop_checker is not None:
            checker = tracked.stop_checker
            safe, matched = checker.feed(text) if text else ("", -1)
            if finished and matched < 0:
                # the end can settle a match that waited on a longer, earlier-starting stop string
                safe += checker.flush()
                matched = checker.matched_index
            if matched >= 0:
                self._count_reasoning(tracked, ids, safe)
                mailbox.put_text(index, safe, entries, all_ids)
                mailbox.finish(index, "stop")
                del self._requests[output.request_id]
                self._observe(output, "stop")
                return not finished
            text = safe
        self._count_reasoning(tracked, ids, text)
        mailbox.put_text(index, text, entries, all_ids)
        self._observe(output, output.finish_reason if finished else None)
        if finished:
            del self._requests[output.request_id]
            self._finish(mailbox, index, output)
        return False

    @staticmethod
    def _finish(mailbox: Mailbox, index: int, output: RequestOutput) -> None:
        reason = output.finish_reason
        if reason in ("stop", "length"):
            mailbox.finish(index, reason)
        elif reason == "abort":
            mailbox.fail(output.error or "The request was aborted by the engine.")
        else:
            mailbox.fail(output.error or "The engine failed while generating this response.",
                         output.error_code or "engine_error")
