"""GPT-OSS "harmony" output: messages on channels, the ``analysis`` channel is the reasoning.

The format (openai-harmony's documentation, the GPT-OSS chat template): the generation prompt ends
with ``<|start|>assistant``, and the model writes messages

    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>

each a header (role, ``<|channel|>NAME``, optionally `` to=RECIPIENT`` and ``<|constrain|>TYPE``) up
to ``<|message|>``, a body, and a terminator (``<|end|>``, ``<|call|>`` or ``<|return|>``; the last
two are end-of-sequence tokens, so the engine leaves them out of the text). The markers are special
tokens: the detokenizer keeps them as text for this parser (``marker_texts``).

What goes where (vLLM's ``openai_gptoss`` parser puts analysis in the reasoning, the final message in
the content):

- body of an ``analysis`` message: **reasoning** (several analysis messages concatenate as they are);
- body of a ``final`` message, of a ``commentary`` message without recipient (a preamble shown to
  the user) or of a message on another channel: **content**;
- a message with a recipient (`` to=functions.NAME``: a tool call, on ``commentary``; or a built-in
  tool on ``analysis``): **content, verbatim**, header, body and terminator as the model wrote them,
  so it stays out of the reasoning and a harmony tool-call parser downstream reads it whole;
- headers and terminators of the other messages are markup, in neither field; a header the output
  ended inside is dropped;
- output that is not harmony (text that cannot begin a header where one is due, or a header longer
  than :data:`MAX_HEADER_CHARS`) is content from there on, unchanged.
"""

from __future__ import annotations

import re

from proxy.reasoning.base import ReasoningParser, held_prefix_len

__all__ = ["HARMONY_MARKERS", "MAX_HEADER_CHARS", "HarmonyParser"]

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
TERMINATORS = (END, CALL, RETURN)
HARMONY_MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
"""Every harmony marker (special tokens of the GPT-OSS vocabulary)."""
ANALYSIS_OPEN = CHANNEL + "analysis" + MESSAGE
"""A prompt ending with this starts the output inside the reasoning."""

MAX_HEADER_CHARS = 256
"""Longest header (text before ``<|message|>``) read as one; longer text is not harmony."""

_OPENERS = (START, CHANNEL, " to=", CONSTRAIN)  # how a header can begin (the first one follows the role)
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z0-9_]+)")

_HEADER, _BODY, _PLAIN = 0, 1, 2
_TO_REASONING, _TO_CONTENT, _RAW = 0, 1, 2


def _can_open(text: str) -> bool:
    """``text`` starts with a header opener, or is a prefix of one."""
    return any(text.startswith(o) or o.startswith(text) for o in _OPENERS)


class HarmonyParser(ReasoningParser):
    """Harmony reasoning parser of one choice (rules in the module docstring).

    Args:
        in_reasoning: the output starts inside an ``analysis`` body (the prompt ended with
            :data:`ANALYSIS_OPEN`); otherwise it starts with a header, after ``<|start|>assistant``.
    """

    def __init__(self, *, in_reasoning: bool = False) -> None:
        self._state = _BODY if in_reasoning else _HEADER
        self._kind = _TO_REASONING
        self._held = ""
        self._final_seen = False

    @property
    def in_reasoning(self) -> bool:
        """See :attr:`ReasoningParser.in_reasoning`: inside an analysis body."""
        return self._state == _BODY and self._kind == _TO_REASONING

    @property
    def reasoning_ended(self) -> bool:
        """See :attr:`ReasoningParser.reasoning_ended`: a ``final`` message began (or not harmony)."""
        return self._final_seen or self._state == _PLAIN

    def feed(self, text: str) -> tuple[str, str]:
        """See :meth:`ReasoningParser.feed`."""
        if self._state == _PLAIN:
            return "", text
        buf = self._held + text
        if self._state == _BODY and "<|" not in buf:  # no marker in sight: at most a trailing "<" waits
            keep = 1 if buf.endswith("<") else 0
            self._held = buf[len(buf) - keep:]
            body = buf[: len(buf) - keep]
            return (body, "") if self._kind == _TO_REASONING else ("", body)
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while buf:
            if self._state == _PLAIN:
                content.append(buf)
                break
            if self._state == _HEADER:
                buf = self._read_header(buf, content)
                if self._state == _HEADER:  # incomplete: held
                    break
                continue
            end, term = self._find_terminator(buf)
            out = reasoning if self._kind == _TO_REASONING else content
            if end < 0:
                keep = held_prefix_len(buf, TERMINATORS)
                out.append(buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep:]
                break
            out.append(buf[:end])
            if self._kind == _RAW:
                content.append(term)
            self._state = _HEADER
            buf = buf[end + len(term):]
        return "".join(reasoning), "".join(content)

    def _read_header(self, buf: str, content: list[str]) -> str:
        """Read a header from ``buf``; returns the text after it. Stays in ``_HEADER`` (holding
        ``buf``) while the header is incomplete, switches to ``_PLAIN`` when it is not harmony."""
        if not _can_open(buf):
            self._state = _PLAIN
            return buf
        pos = buf.find(MESSAGE)
        if pos < 0 or pos > MAX_HEADER_CHARS:
            if pos > MAX_HEADER_CHARS or len(buf) - len(MESSAGE) + 1 > MAX_HEADER_CHARS:
                self._state = _PLAIN
                return buf
            self._held = buf
            return ""
        header = buf[:pos]
        match = _CHANNEL_NAME.search(header)
        channel = match.group(1) if match else ""
        if " to=" in header or header.startswith("to="):
            self._kind = _RAW
            content.append(header + MESSAGE)
        else:
            self._kind = _TO_REASONING if channel == "analysis" else _TO_CONTENT
            if channel == "final":
                self._final_seen = True
        self._state = _BODY
        return buf[pos + len(MESSAGE):]

    @staticmethod
    def _find_terminator(buf: str) -> tuple[int, str]:
        best, found = -1, ""
        for term in TERMINATORS:
            i = buf.find(term)
            if i >= 0 and (best < 0 or i < best):
                best, found = i, term
        return best, found

    def flush(self) -> tuple[str, str]:
        """See :meth:`ReasoningParser.flush`: a partial terminator is body text; an unfinished
        header is dropped (markup the output ended inside)."""
        held, self._held = self._held, ""
        if self._state == _BODY:
            return (held, "") if self._kind == _TO_REASONING else ("", held)
        return "", ""
