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
    """Splits one choice's text into reasoning, content and tool calls.

    Args:
        tools: the request's tools when their output is split (``tool_choice`` not ``none``);
            None: all text is content.
        tool_parser: the parser of ``tool_choice: "auto"`` output.
    """

    def __init__(self, tools: ChatTools | None = None, tool_parser: str | None = None) -> None:
        self._tools = ChoiceToolOutput(tools, tool_parser) if tools is not None else None
        self._content: list[str] = []

    def feed(self, text: str) -> ChoiceParts:
        """The next text delta -> the parts known now (a possible partial marker is held back)."""
        if self._tools is None:
            self._content.append(text)
            return ChoiceParts(content=text)
        content, calls = self._tools.feed(text)
        return ChoiceParts(content=content, calls=calls)

    def finish(self, finish_reason: str | None) -> tuple[ChoiceParts, str | None]:
        """End of the choice -> (what was held back, the finish reason to report: ``tool_calls``
        when the model stopped by itself after a call)."""
        if self._tools is None:
            return ChoiceParts(), finish_reason
        content, calls, finish_reason = self._tools.finish(finish_reason)
        return ChoiceParts(content=content, calls=calls), finish_reason

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
        """The non-stream chat ``choices[i].message``: ``role``, ``content`` and (when any) ``tool_calls``."""
        if self._tools is not None:
            return self._tools.message()
        return {"role": "assistant", "content": self.content}
