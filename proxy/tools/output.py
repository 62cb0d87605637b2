"""Per-choice tool-call output: text in, content and ``tool_calls`` out (stream and non-stream).

One :class:`ChoiceToolOutput` per choice of a chat request with tools. The route feeds it the
choice's text deltas and, at the end, its finish reason:

- ``tool_choice: "auto"``: the text goes through the :class:`~proxy.tools.ToolCallParser` of the
  model's format; content streams as it is known not to be part of a call.
- ``"required"`` / named: the grammar made the whole output a JSON value; it is held until the end
  and turned into calls (:meth:`~proxy.tools.request.ChatTools.calls_from_output`). When
  ``max_tokens`` cut it (not complete JSON) it is returned as content with ``"length"``.
- ``"none"``: text is content, unchanged.

A choice that produced at least one call finishes with ``finish_reason: "tool_calls"`` (when the
model stopped by itself; ``"length"`` stays ``"length"``).
"""

from __future__ import annotations

from typing import Any

from proxy.hotpath import dumps
from proxy.tools.parsers import ToolCall, ToolCallDelta, ToolCallParser, call_deltas
from proxy.tools.request import ChatTools

__all__ = ["ChoiceToolOutput", "tool_calls_chunk"]


class ChoiceToolOutput:
    """Splits one choice's output into content and tool calls.

    Args:
        tools: the request's tools and choice.
        parser_name: the ``--tool-call-parser`` format (needed for ``"auto"``).
    """

    def __init__(self, tools: ChatTools, parser_name: str | None) -> None:
        self.tools = tools
        self.parser = ToolCallParser(parser_name) if tools.is_parsed and parser_name else None
        self._held: list[str] = []
        self._content: list[str] = []
        self.tool_calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The next text delta -> (content to show now, completed call deltas)."""
        if not text:
            return "", []
        if self.tools.is_constrained:
            self._held.append(text)
            return "", []
        if self.parser is not None:
            content, deltas = self.parser.feed(text)
            self.tool_calls = self.parser.tool_calls
        else:
            content, deltas = text, []
        self._content.append(content)
        return content, deltas

    def finish(self, finish_reason: str | None) -> tuple[str, list[ToolCallDelta], str | None]:
        """End of the choice -> (last content, last call deltas, the finish reason to report)."""
        content, deltas = "", []
        if self.tools.is_constrained:
            text = "".join(self._held)
            calls = self.tools.calls_from_output(text) if finish_reason == "stop" else None
            if calls is None:
                content = text
            else:
                for call in calls:
                    deltas.extend(call_deltas(len(self.tool_calls), call))
                    self.tool_calls.append(call)
        elif self.parser is not None:
            content, deltas = self.parser.flush()
            self.tool_calls = self.parser.tool_calls
        self._content.append(content)
        if self.tool_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return content, deltas, finish_reason

    @property
    def content(self) -> str | None:
        """All content so far; None when empty (OpenAI's ``content: null`` next to tool calls)."""
        text = "".join(self._content)
        return text if text or not self.tool_calls else None

    def message(self) -> dict[str, Any]:
        """The non-stream ``choices[i].message``: ``role``, ``content`` and (when any) ``tool_calls``."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        return msg


def tool_calls_chunk(response_id: str, created: int, model: str, index: int,
                     deltas: list[ToolCallDelta]) -> bytes:
    """One SSE event carrying ``delta.tool_calls`` for choice ``index`` (OpenAI's chunk shape)."""
    chunk = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": {"tool_calls": [d.to_openai() for d in deltas]},
                     "logprobs": None, "finish_reason": None}],
    }
    return b"data: " + dumps(chunk).encode() + b"\n\n"
