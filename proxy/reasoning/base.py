"""What every reasoning parser is: one choice's output text in, reasoning and content deltas out.

:class:`ReasoningParser` is the interface the output pipeline calls (detokenizer -> stop checker ->
reasoning parser -> tool-call parser, per choice); :func:`held_prefix_len` is the hold-back rule the
parsers share with the stop checker (``proxy.hotpath.StopChecker``) and the tool-call parsers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ReasoningParser", "ReasoningResult", "held_prefix_len"]


def held_prefix_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``: the text
    a parser holds back because the next delta may complete a marker (the stop checker's rule).

    Returns 0 when no suffix can start a marker. Works on code points; looks only at the places in
    the last ``len(marker) - 1`` characters where the marker's first character occurs.
    """
    best = 0
    n = len(text)
    for marker in markers:
        first = marker[0]
        i = text.find(first, max(0, n - len(marker) + 1))
        while 0 <= i and n - i > best:
            if marker.startswith(text[i:]):
                best = n - i
                break
            i = text.find(first, i + 1)
    return best


@dataclass(frozen=True)
class ReasoningResult:
    """A whole output split by :meth:`ReasoningParser.parse` (the non-stream path).

    Attributes:
        reasoning: the thinking text (``message.reasoning_content`` / ``reasoning``); "" when the
            output had none.
        content: the answer text (``message.content``, and what a tool-call parser reads); "" when
            the output had none.
    """

    reasoning: str
    content: str


class ReasoningParser(ABC):
    """Incremental reasoning parser for one choice (one instance per choice, fed in output order).

    Contract, for every parser:

    - ``feed(text)`` takes the next piece of output text (what the detokenizer, with the parser's
      ``marker_texts`` kept as text where they are special tokens, and the stop checker let through)
      and returns ``(reasoning_delta, content_delta)``, each possibly "".
    - ``flush()`` at the end of the output returns what was held back, in the same shape.
    - A marker split across tokens or deltas never reaches either field: the longest suffix that
      could still become a marker is held back (:func:`held_prefix_len`).
    - Any split of a text into deltas gives the same concatenated reasoning and content as one
      ``feed`` of the whole text followed by ``flush`` (so stream == non-stream); the markers
      (tags, harmony headers) are the only text in neither field.
    """

    @abstractmethod
    def feed(self, text: str) -> tuple[str, str]:
        """Consume the next piece of output text; returns ``(reasoning_delta, content_delta)``."""

    @abstractmethod
    def flush(self) -> tuple[str, str]:
        """End of output: release held-back text as ``(reasoning_delta, content_delta)``."""

    @property
    @abstractmethod
    def in_reasoning(self) -> bool:
        """Text fed now would be reasoning (inside the thinking, or about to start in it).

        ``usage.completion_tokens_details.reasoning_tokens``: count the tokens for which this is
        True just before their text is fed (one ``feed`` per token): the tokens that start inside
        the reasoning, the close tag's included, an open tag the model wrote itself not."""

    @property
    @abstractmethod
    def reasoning_ended(self) -> bool:
        """The end of the reasoning was read (the closing tag; harmony: a final-channel message
        began): from here on the output is the answer (where a grammar would apply)."""

    def parse(self, text: str) -> ReasoningResult:
        """Split a whole output (the non-stream path): exactly ``feed(text)`` then ``flush()``."""
        r1, c1 = self.feed(text)
        r2, c2 = self.flush()
        return ReasoningResult(r1 + r2, c1 + c2)
