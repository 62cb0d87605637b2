"""One choice's output text -> the parts a wire format writes: reasoning, content, tool-call deltas.

Every wire format (chat chunks, chat bodies, Responses events and items) reads a choice through one
:class:`ChoiceOutput`, so they split the text the same way. A stream feeds it the detokenizer's
deltas; a whole body feeds it the whole text at once; both end with :meth:`ChoiceOutput.finish`.
Because each splitter holds back a possible partial marker until it is known, the streamed parts
concatenate to the parts of the whole text, whatever the chunking.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.reasoning import ReasoningParser
from proxy.tools.output import ChoiceToolOutput
from proxy.tools.parsers import ToolCall, ToolCallDelta
from proxy.tools.request import ChatTools


@dataclass
class ChoiceParts:
    """What one piece of a choice's output adds to each field.

    Attributes:
        reasoning: thinking text (``reasoning_content``); "" when none.
        content: answer text (``content``).
        calls: tool-call deltas (headers and argument fragments), in order.
    """

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ChoiceOutput:
    """Splits one choice's text into reasoning, content and tool calls, in that order: the reasoning
    parser first (its thinking is never parsed for calls: a call-looking text inside it stays
    reasoning), the tool-call splitter on what it leaves as content.

    Args:
        tools: the request's tools when their output is split (``tool_choice`` not ``none``);
            None: all text after the reasoning is content.
        tool_parser: the parser of ``tool_choice: "auto"`` output.
        reasoning: the choice's reasoning parser (``proxy.reasoning.get_reasoning_parser``); None:
            no thinking is split off.
    """

    def __init__(self, tools: ChatTools | None = None, tool_parser: str | None = None,
                 reasoning: ReasoningParser | None = None) -> None:
        self._tools = ChoiceToolOutput(tools, tool_parser) if tools is not None else None
        self._reasoning_parser = reasoning
        self._content: list[str] = []
        self._reasoning: list[str] = []

    def _split(self, reasoning: str, content: str) -> ChoiceParts:
        if reasoning:
            self._reasoning.append(reasoning)
        if self._tools is None:
            self._content.append(content)
            return ChoiceParts(reasoning, content)
        text, calls = self._tools.feed(content)
        return ChoiceParts(reasoning, text, calls)

    def feed(self, text: str) -> ChoiceParts:
        """The next text delta -> the parts known now (a possible partial marker is held back)."""
        if self._reasoning_parser is None:
            return self._split("", text)
        return self._split(*self._reasoning_parser.feed(text))

    def finish(self, finish_reason: str | None) -> tuple[ChoiceParts, str | None]:
        """End of the choice -> (what was held back, the finish reason to report: ``tool_calls``
        when the model stopped by itself after a call)."""
        parts = ChoiceParts()
        if self._reasoning_parser is not None:
            parts = self._split(*self._reasoning_parser.flush())
        if self._tools is None:
            return parts, finish_reason
        content, calls, finish_reason = self._tools.finish(finish_reason)
        return ChoiceParts(parts.reasoning, parts.content + content, parts.calls + calls), finish_reason

    @property
    def reasoning(self) -> str | None:
        """All thinking so far; None when there was none (the field is then left out)."""
        return "".join(self._reasoning) or None

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls so far."""
        return self._tools.tool_calls if self._tools is not None else []

    @property
    def content(self) -> str | None:
        """All content so far; None when empty beside tool calls (OpenAI's ``content: null``)."""
        if self._tools is not None:
            return self._tools.content
        return "".join(self._content)

    def message(self) -> dict[str, Any]:
        """The non-stream chat ``choices[i].message``: ``role``, ``content``, the thinking as
        ``reasoning_content`` and ``reasoning`` (when any) and ``tool_calls`` (when any)."""
        msg = (self._tools.message() if self._tools is not None
               else {"role": "assistant", "content": self.content})
        reasoning = self.reasoning
        if reasoning is not None:
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        return msg
