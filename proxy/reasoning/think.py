"""Reasoning between an open and a close tag: ``<think>...</think>`` (Qwen3, DeepSeek-R1, QwQ, SmolLM3,
GLM) and ``[THINK]...[/THINK]`` (Magistral).

The rules, for every split of the output into deltas:

- **Start.** The open tag is honoured only as the first text of the output, after optional
  whitespace (the whitespace counts with the tag: it is in neither field). While the output so far
  is whitespace or a prefix of the open tag, it is held. Otherwise the output starts in the
  reasoning when ``in_reasoning`` (the chat template's generation prompt ended with the open tag, or
  the format assumes it, as vLLM's ``deepseek_r1`` does), else in the content.
- **Reasoning** runs to the first close tag; no close tag at all: everything is reasoning (a
  ``max_tokens`` cut inside the thinking, vLLM's ``deepseek_r1`` rule). Only the close tag ends it:
  a tool-call marker (``<tool_call>``) inside the thinking stays reasoning.
- **Content** is everything after the first close tag, unchanged (a second close tag, or a new open
  tag, stays in the content: only the first one splits). Output that started in the content stays
  content: a close tag there is content text (vLLM's ``qwen3``: no open and no close tag, all
  content).
- The whitespace after the close tag stays in the content (``"</think>\\n\\nAnswer"`` gives content
  ``"\\n\\nAnswer"``), so reasoning + content + the tags (+ the whitespace before the open tag) is
  exactly the output text.
"""

from __future__ import annotations

from proxy.reasoning.base import ReasoningParser, held_prefix_len

__all__ = ["ThinkTagParser"]

_START, _REASONING, _CONTENT = 0, 1, 2


class ThinkTagParser(ReasoningParser):
    """Open/close-tag reasoning parser of one choice (rules in the module docstring).

    Args:
        open_tag, close_tag: the markers, e.g. ``"<think>"`` and ``"</think>"``.
        in_reasoning: the output starts inside the reasoning (before any open tag).

    Raises:
        ValueError: an empty tag.
    """

    def __init__(self, open_tag: str, close_tag: str, *, in_reasoning: bool) -> None:
        if not open_tag or not close_tag:
            raise ValueError("reasoning tags must be non-empty")
        self._open = open_tag
        self._close = close_tag
        self._close_first = close_tag[0]
        self._starts_in_reasoning = in_reasoning
        self._state = _START
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        """See :attr:`ReasoningParser.in_reasoning`."""
        return self._state == _REASONING or (self._state == _START and self._starts_in_reasoning)

    @property
    def reasoning_ended(self) -> bool:
        """See :attr:`ReasoningParser.reasoning_ended` (also True for output that started as content)."""
        return self._state == _CONTENT

    def feed(self, text: str) -> tuple[str, str]:
        """See :meth:`ReasoningParser.feed`."""
        state = self._state
        if state == _CONTENT:
            return "", text
        if state == _REASONING and not self._held and self._close_first not in text:
            return text, ""  # the common case: no part of a close tag in sight
        held = self._held + text
        if state == _START:
            body = held.lstrip()
            if not body or (len(body) < len(self._open) and self._open.startswith(body)):
                self._held = held
                return "", ""
            if body.startswith(self._open):
                held = body[len(self._open):]
            elif not self._starts_in_reasoning:
                self._state, self._held = _CONTENT, ""
                return "", held
            self._state = _REASONING
        end = held.find(self._close)
        if end >= 0:
            self._state, self._held = _CONTENT, ""
            return held[:end], held[end + len(self._close):]
        keep = held_prefix_len(held, (self._close,))
        self._held = held[len(held) - keep:]
        return held[: len(held) - keep], ""

    def flush(self) -> tuple[str, str]:
        """See :meth:`ReasoningParser.flush`: a partial tag is text of the field it is in."""
        held, self._held = self._held, ""
        if self._state == _START and not self._starts_in_reasoning:
            self._state = _CONTENT
            return "", held
        return held, ""
