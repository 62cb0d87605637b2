"""Per-choice tool-call output: text in, content and ``tool_calls`` out (stream and non-stream).

One :class:`ChoiceToolOutput` per choice of a chat request with tools. The route feeds it the
choice's text deltas and, at the end, its finish reason:

- ``tool_choice: "auto"``: the text goes through the :class:`~proxy.tools.ToolCallParser` of the
  model's format; content streams as it is known not to be part of a call.
- ``"required"`` / named: the grammar made the whole output a JSON value (an array of
  ``{"name", "parameters"}``, or the named function's arguments object); a
  :class:`~proxy.tools.CallStream` reads it as it comes, so each call's header goes out once its
  name is known and its arguments stream fragment by fragment, as the model generates them. When
  ``max_tokens`` cuts a call, the call stays with the arguments that came (``finish_reason:
  "length"``, as OpenAI answers); output cut before any call started is returned as content.
- ``"none"``: text is content, unchanged.

A choice that produced at least one call finishes with ``finish_reason: "tool_calls"`` (when the
model stopped by itself; ``"length"`` stays ``"length"``).
"""

from __future__ import annotations

from typing import Any

from proxy.tools.parsers import CallStream, PendingCall, ToolCall, ToolCallDelta, ToolCallParser, call_deltas
from proxy.tools.request import ChatTools

__all__ = ["ChoiceToolOutput"]


class ChoiceToolOutput:
    """Splits one choice's output into content and tool calls.

    Args:
        tools: the request's tools and choice.
        parser_name: the ``--tool-call-parser`` format (needed for ``"auto"``).
    """

    def __init__(self, tools: ChatTools, parser_name: str | None) -> None:
        self.tools = tools
        self.parser = ToolCallParser(parser_name) if tools.is_parsed and parser_name else None
        self._calls: list[PendingCall] = []
        self._stream: CallStream | None = None
        if tools.is_constrained:
            self._stream = CallStream(
                self._calls, tools.choice.name if tools.choice.mode == "named" else None
            )
        self._content: list[str] = []

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls so far (the last one's arguments still growing while it streams)."""
        if self.parser is not None:
            return self.parser.tool_calls
        return [c.to_call() for c in self._calls]

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The next text delta -> (content to show now, tool-call deltas: headers, arguments fragments)."""
        if not text:
            return "", []
        if self._stream is not None:
            return "", self._stream.feed(text)
        if self.parser is not None:
            content, deltas = self.parser.feed(text)
        else:
            content, deltas = text, []
        self._content.append(content)
        return content, deltas

    def finish(self, finish_reason: str | None) -> tuple[str, list[ToolCallDelta], str | None]:
        """End of the choice -> (last content, last call deltas, the finish reason to report)."""
        content, deltas = "", []
        if self._stream is not None and not self._stream.committed:
            text = self._stream.text
            calls = self.tools.calls_from_output(text) if finish_reason == "stop" else None
            if calls is None:
                content = text
            else:
                for call in calls:
                    deltas.extend(call_deltas(len(self._calls), call))
                    self._calls.append(PendingCall(call.name, call.arguments, call.id))
        elif self.parser is not None:
            content, deltas = self.parser.flush()
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
