"""The per-request mailbox between output processing and one HTTP response.

One slot per choice: text that arrives while the consumer (the HTTP response) is still busy is
appended to the pending text of that choice instead of being queued as another frame, so a
lagging client costs at most its own generated text and gets fewer, larger chunks (the coalescing
policy: the engine never waits on HTTP). The consumer takes everything pending when it wakes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from proxy.engine.request import IMAGE_ENCODING_FAILED
from proxy.errors import EngineError, InvalidRequestError, ServiceUnavailableError, StreamproxyError
from proxy.protocol import LogprobEntry


@dataclass
class ChoiceDelta:
    """What one choice has pending for the consumer (the unit a :class:`Generation` yields).

    Attributes:
        index: the choice (0 .. n-1).
        text: new text, safe to show (complete characters, no pending stop-string match).
        token_ids: the generated tokens this delta accounts for (an EOS or stop token that ended
            the choice included; its text is not in ``text``).
        logprobs: one entry per token whose text is in ``text`` (held-back tokens come later),
            empty when logprobs were not requested.
        finish_reason: ``"stop"`` / ``"length"`` on the choice's last delta, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobEntry]
    finish_reason: str | None


@dataclass
class _ChoiceSlot:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    held_logprobs: list[LogprobEntry] = field(default_factory=list)  # tokens whose text is held back
    finish_reason: str | None = None
    is_finished: bool = False
    is_finish_taken: bool = False
    num_output_tokens: int = 0


class Mailbox:
    """One slot per choice; producer: the ``OutputProcessor``, consumer: a ``Generation``.

    Producer side (event loop): :meth:`put_text`, :meth:`finish`, :meth:`fail`. Consumer side:
    ``await`` :meth:`wait`, then :meth:`take` everything pending. Pending text of a choice is
    merged, never queued frame by frame.
    """

    def __init__(self, num_choices: int) -> None:
        self._slots = [_ChoiceSlot() for _ in range(num_choices)]
        self._event = asyncio.Event()
        self.error: StreamproxyError | None = None
        self.num_cached_tokens = 0
        """Prompt tokens of choice 0 served from the prefix cache (for ``usage``)."""
        self.num_reasoning_tokens: int | None = None
        """Output tokens of all choices generated inside the thinking (None: no reasoning parser)."""

    @property
    def num_choices(self) -> int:
        return len(self._slots)

    # producer -------------------------------------------------------------------------------
    def put_text(self, index: int, text: str, logprobs: Sequence[LogprobEntry] = (),
                 token_ids: Sequence[int] = ()) -> None:
        """Append ``text`` (and the tokens and logprobs that produced it) to choice ``index``.

        Logprobs of tokens whose text is still held back (an incomplete UTF-8 character, a possible
        stop string) are kept apart without waking the consumer; they go out with the next text or
        the finish, so each chunk carries the entries of the tokens that produced its text.
        """
        slot = self._slots[index]
        if slot.is_finished:
            return
        slot.num_output_tokens += len(token_ids)
        slot.token_ids.extend(token_ids)
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

        ``code`` ``"server_shutdown"`` (the shutdown grace period ran out) becomes a
        :class:`ServiceUnavailableError`, ``IMAGE_ENCODING_FAILED`` (the vision encoder could not
        encode the request's images) an :class:`InvalidRequestError` (400), anything else an
        :class:`EngineError` (a failed step).
        """
        if self.error is None:
            if code == "server_shutdown":
                self.error = ServiceUnavailableError(message, code=code)
            elif code == IMAGE_ENCODING_FAILED:
                self.error = InvalidRequestError(message, code=code)
            else:
                self.error = EngineError(message, code=code)
        self._event.set()

    # consumer -------------------------------------------------------------------------------
    async def wait(self) -> None:
        """Return once something is pending (text, a finish or an error); cancel-safe."""
        await self._event.wait()

    @property
    def has_pending(self) -> bool:
        return self._event.is_set()

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
            deltas.append(ChoiceDelta(i, "".join(slot.text), slot.token_ids, slot.logprobs, finish))
            slot.text, slot.token_ids, slot.logprobs = [], [], []
        return deltas

    @property
    def is_finished(self) -> bool:
        """Every choice finished and its finish taken by the consumer, or an error is pending."""
        return self.error is not None or all(s.is_finish_taken for s in self._slots)

    @property
    def num_output_tokens(self) -> int:
        """Completion tokens over all choices (for ``usage``)."""
        return sum(s.num_output_tokens for s in self._slots)
