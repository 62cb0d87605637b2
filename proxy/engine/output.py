"""Engine outputs -> detokenized, stop-checked text in a per-request mailbox.

The engine thread hands each step's :class:`RequestOutput`s to the event loop; the
:class:`OutputProcessor` runs there (one call per output) and, per choice, feeds the new token ids
to the hot path's incremental detokenizer and stop checker. The text that is safe to show is put
into the HTTP request's :class:`Mailbox`.

The mailbox has one slot per choice: text that arrives while the consumer (the HTTP response) is
still busy is appended to the pending text of that choice instead of being queued as another
frame, so a lagging client costs at most its own generated text and gets fewer, larger chunks
(the coalescing policy of ``../shared/DESIGN.md``). The consumer frames what is pending when it
wakes.

A stop-string match finishes the choice with ``finish_reason="stop"`` and aborts the request in
the engine (vLLM does the same: stop strings are checked on detokenized text, outside the engine).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.sampling import SamplingParams

LOGPROB_FLOOR = -9999.0
"""-inf is not JSON; like vLLM, log-probabilities are clamped to this floor."""


class _Detokenizer(Protocol):
    def feed(self, ids: Sequence[int]) -> str: ...
    def flush(self) -> str: ...


class TokenizerLike(Protocol):
    """The part of :class:`proxy.tokenizer.Tokenizer` the output path uses."""

    def new_detokenizer(self) -> _Detokenizer: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def token_text(self, token_id: int) -> str: ...


@dataclass(frozen=True)
class LogprobEntry:
    """Log-probability of one generated token and its most likely alternatives.

    Attributes:
        token: the token's text (``Tokenizer.token_text``); may be a partial character.
        token_bytes: the exact bytes the token contributes to the output text.
        logprob: natural log-probability, clamped to :data:`LOGPROB_FLOOR`.
        top: ``(token, logprob, bytes)`` of the alternatives, most likely first.
    """

    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    top: tuple[tuple[str, float, bytes], ...]

    def to_chat(self) -> dict[str, Any]:
        """One entry of chat ``logprobs.content`` (OpenAI ``ChatCompletionTokenLogprob``)."""
        return {
            "token": self.token,
            "logprob": self.logprob,
            "bytes": list(self.token_bytes),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, lp, b in self.top],
        }


def chat_logprobs(entries: Sequence[LogprobEntry]) -> dict[str, Any]:
    """Chat ``logprobs`` object: ``{"content": [entry, ...]}``."""
    return {"content": [e.to_chat() for e in entries]}


def _legacy_top(entry: LogprobEntry) -> dict[str, float]:
    """The alternatives plus the sampled token: OpenAI "Create completion" says the sampled token's
    logprob is always returned, "so there may be up to logprobs+1 elements" (vLLM does the same)."""
    top = {t: lp for t, lp, _ in entry.top}
    top.setdefault(entry.token, entry.logprob)
    return top


def completion_logprobs(entries: Sequence[LogprobEntry], text_offset: int) -> dict[str, Any]:
    """Legacy completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``.

    ``text_offset[i]`` is the character offset of token ``i`` in the choice's text, counted from
    ``text_offset`` (the characters of earlier chunks), summing ``len(token)`` like vLLM does.
    """
    offsets = []
    pos = text_offset
    for e in entries:
        offsets.append(pos)
        pos += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_legacy_top(e) for e in entries],
        "text_offset": offsets,
    }


@dataclass
class ChoiceDelta:
    """What one choice has pending for the consumer: new text, its logprobs, maybe the finish."""

    index: int
    text: str
    logprobs: list[LogprobEntry]
    finish_reason: str | None


@dataclass
class _ChoiceSlot:
    text: list[str] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    held_logprobs: list[LogprobEntry] = field(default_factory=list)  # tokens whose text is held back
    finish_reason: str | None = None
    is_finished: bool = False
    is_finish_taken: bool = False
    num_output_tokens: int = 0


class Mailbox:
    """The one-slot-per-choice hand-off between the output processor and one HTTP response.

    Producer side (event loop, from :class:`OutputProcessor`): :meth:`put_text`, :meth:`finish`,
    :meth:`fail`. Consumer side: ``await`` :meth:`wait`, then :meth:`take` everything pending.
    Pending text of a choice is merged, never queued frame by frame.
    """

    def __init__(self, num_choices: int) -> None:
        self._slots = [_ChoiceSlot() for _ in range(num_choices)]
        self._event = asyncio.Event()
        self.error: str | None = None
        self.error_code = "engine_error"
        self._error_taken = False

    @property
    def num_choices(self) -> int:
        return len(self._slots)

    # producer -------------------------------------------------------------------------------
    def put_text(self, index: int, text: str, logprobs: Sequence[LogprobEntry] = (), num_tokens: int = 0) -> None:
        """Append ``text`` (and the logprobs of the tokens that produced it) to choice ``index``.

        Logprobs of tokens whose text is still held back (an incomplete UTF-8 character, a possible
        stop string) are kept apart without waking the consumer; they go out with the next text or
        the finish, so each chunk carries the entries of the tokens that produced its text.
        """
        slot = self._slots[index]
        if slot.is_finished:
            return
        slot.num_output_tokens += num_tokens
        if not text:
            slot.held_logprobs.extend(logprobs)
            return
        if slot.held_logprobs:
            slot.logprobs.extend(slot.held_logprobs)
            slot.held_logprobs = []
        slot.logprobs.extend(logprobs)
        slot.text.append(text)
        self._event.set()

    def finish(self, index: int, finish_reason: str) -> None:
        """Mark choice ``index`` finished (``"stop"`` or ``"length"``); later puts are ignored."""
        slot = self._slots[index]
        if slot.is_finished:
            return
        slot.is_finished = True
        slot.finish_reason = finish_reason
        slot.logprobs.extend(slot.held_logprobs)
        slot.held_logprobs = []
        self._event.set()

    def fail(self, message: str, code: str = "engine_error") -> None:
        """End the whole response with an error (first error wins).

        ``code`` becomes the OpenAI error ``code`` of the SSE error event: ``"engine_error"``
        (a failed engine step) or ``"server_shutdown"`` (the shutdown grace period ran out).
        """
        if self.error is None:
            self.error = message
            self.error_code = code
        self._event.set()

    def interrupt(self) -> None:
        """Wake the consumer without new output (the client went away)."""
        self._event.set()

    # consumer -------------------------------------------------------------------------------
    async def wait(self) -> None:
        """Return once something is pending (text, a finish or an error)."""
        await self._event.wait()

    def take(self) -> list[ChoiceDelta]:
        """Everything pending, one :class:`ChoiceDelta` per choice that has text or a new finish."""
        self._event.clear()
        deltas = []
        for i, slot in enumerate(self._slots):
            finish = slot.finish_reason if slot.is_finished and not slot.is_finish_taken else None
            if not slot.text and finish is None:
                continue
            if finish is not None:
                slot.is_finish_taken = True
            deltas.append(ChoiceDelta(i, "".join(slot.text), slot.logprobs, finish))
            slot.text = []
            slot.logprobs = []
        return deltas

    @property
    def is_finished(self) -> bool:
        """Every choice finished and its finish taken by the consumer, or an error is pending."""
        return self.error is not None or all(s.is_finish_taken for s in self._slots)

    @property
    def num_output_tokens(self) -> int:
        """Completion tokens over all choices (for ``usage``)."""
        return sum(s.num_output_tokens for s in self._slots)

    def choice_output_tokens(self, index: int) -> int:
        return self._slots[index].num_output_tokens


@dataclass
class _Tracked:
    mailbox: Mailbox
    index: int
    params: SamplingParams
    detokenizer: _Detokenizer
    stop_checker: Any | None


class OutputProcessor:
    """Routes engine outputs to the mailboxes of their HTTP requests (runs on the event loop).

    Args:
        tokenizer: gives ``new_detokenizer()``, ``token_text`` and ``token_bytes``.
        abort: called with the engine request id when a stop string finishes a choice
            (``AsyncEngine.abort``).
        stop_checker_factory: builds a stop checker for a tuple of stop strings; default: the
            hot path's ``StopChecker``.
        observer: optional ``(output, finish_reason)`` callback run for every tracked output, with
            the finish reason this processor decided (``"stop"`` also for a stop-string match) or
            None while the request runs; ``(None, "abort")`` is not sent, see :meth:`remove`.
    """

    def __init__(self, tokenizer: TokenizerLike, abort: Callable[[str], None],
                 stop_checker_factory: Callable[[Sequence[str]], Any] | None = None,
                 observer: Callable[[Any, str | None], None] | None = None,
                 on_abort: Callable[[str], None] | None = None) -> None:
        if stop_checker_factory is None:
            from proxy.hotpath import StopChecker

            stop_checker_factory = StopChecker
        self._tokenizer = tokenizer
        self._abort = abort
        self._new_stop_checker = stop_checker_factory
        self._requests: dict[str, _Tracked] = {}
        self._observer = observer
        self._on_abort = on_abort

    @property
    def num_tracked(self) -> int:
        """Engine requests whose outputs are still expected."""
        return len(self._requests)

    def add(self, request_id: str, mailbox: Mailbox, index: int, params: SamplingParams) -> None:
        """Start tracking engine request ``request_id`` as choice ``index`` of ``mailbox``."""
        stop = self._new_stop_checker(params.stop) if params.stop else None
        self._requests[request_id] = _Tracked(mailbox, index, params, self._tokenizer.new_detokenizer(), stop)

    def remove(self, request_id: str) -> None:
        """Stop tracking (idempotent); later outputs of this request are dropped."""
        self._requests.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop tracking a request that is being aborted (client gone); reports it to ``on_abort``."""
        if self._requests.pop(request_id, None) is not None and self._on_abort is not None:
            self._on_abort(request_id)

    def fail_all(self, message: str, code: str = "server_shutdown") -> int:
        """End every tracked request now: its mailbox fails with ``message``/``code`` and the engine
        request is aborted. Used when the shutdown grace period ends (``ServerState.begin_drain``).

        The requests stay tracked until their HTTP response closes them (``abort``), so the
        metrics still count them as aborted. Returns the number of requests ended.
        """
        ended = [rid for rid, t in self._requests.items() if t.mailbox.error is None]
        for rid, tracked in list(self._requests.items()):
            tracked.mailbox.fail(message, code)
        for rid in ended:
            self._abort(rid)
        return len(ended)

    def _entries(self, output: Any) -> list[LogprobEntry]:
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

    def process(self, output: Any) -> None:
        """Handle one ``RequestOutput`` (the ``on_output`` callback given to ``AsyncEngine.submit``)."""
        tracked = self._requests.get(output.request_id)
        if tracked is None:
            return
        mailbox, index = tracked.mailbox, tracked.index
        entries = self._entries(output) if tracked.params.logprobs else []
        finished = bool(output.finished)
        ids = output.new_token_ids
        stop_token = getattr(output, "stop_reason", None)
        if finished and stop_token is not None and ids and ids[-1] == stop_token:
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
                mailbox.put_text(index, safe, entries, len(output.new_token_ids))
                mailbox.finish(index, "stop")
                self.remove(output.request_id)
                if not finished:
                    self._abort(output.request_id)
                if self._observer is not None:
                    self._observer(output, "stop")
                return
            text = safe
        mailbox.put_text(index, text, entries, len(output.new_token_ids))
        if self._observer is not None:
            self._observer(output, output.finish_reason if finished else None)
        if not finished:
            return
        self.remove(output.request_id)
        reason = output.finish_reason
        if reason in ("stop", "length"):
            mailbox.finish(index, reason)
        elif reason == "abort":
            mailbox.fail(output.error or "The request was aborted by the engine.")
        else:
            mailbox.fail(output.error or "The engine failed while generating this response.")

    def process_many(self, outputs: Sequence[Any]) -> None:
        """Handle all outputs of one engine step."""
        for output in outputs:
            self.process(output)
