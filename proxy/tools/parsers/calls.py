"""Tool-call values: complete calls, streamed deltas, calls being streamed, call ids.

The types every tool-call parser produces, in OpenAI's shapes: a complete :class:`ToolCall`
(``message.tool_calls[i]``), a streamed :class:`ToolCallDelta` (``delta.tool_calls[i]``), the
non-stream :class:`ToolParseResult`, and :class:`PendingCall`, a call whose arguments still grow.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "PendingCall",
    "ToolCall",
    "ToolCallDelta",
    "ToolParseResult",
    "call_deltas",
    "coalesce_deltas",
    "new_call_id",
]

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id: ``call_`` + 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    """One complete tool call.

    Attributes:
        id: ``call_...`` id (:func:`new_call_id`).
        name: the function name.
        arguments: the arguments as JSON text (OpenAI sends a string, not an object).
    """

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The non-stream ``message.tool_calls[i]`` object."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of a tool call (``choices[0].delta.tool_calls[i]``).

    The first delta of a call has ``id`` and ``name`` (and ``arguments == ""``); later ones have
    only an ``arguments`` fragment.
    """

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``ChoiceDeltaToolCall`` dict."""
        if self.id is not None:
            return {
                "index": self.index,
                "id": self.id,
                "type": "function",
                "function": {"name": self.name, "arguments": self.arguments},
            }
        return {"index": self.index, "function": {"arguments": self.arguments}}


def call_deltas(index: int, call: ToolCall) -> list[ToolCallDelta]:
    """The stream deltas of one complete call: a header, then the arguments."""
    return [ToolCallDelta(index, call.id, call.name, ""), ToolCallDelta(index, None, None, call.arguments)]


@dataclass
class ToolParseResult:
    """Non-stream result: ``content`` is None when there is no text besides the calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class PendingCall:
    """A call being streamed: its id and name are fixed, its arguments grow (``parts``)."""

    __slots__ = ("id", "name", "parts")

    def __init__(self, name: str, arguments: str = "", call_id: str | None = None) -> None:
        self.id = call_id or new_call_id()
        self.name = name
        self.parts = [arguments]

    def to_call(self) -> ToolCall:
        """The call as it stands (complete once its stream ended)."""
        return ToolCall(self.id, self.name, "".join(self.parts))


def coalesce_deltas(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Merge consecutive arguments fragments of the same call (one delta per call per piece of output)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and d.id is None and out[-1].id is None and out[-1].index == d.index:
            out[-1] = ToolCallDelta(d.index, None, None, out[-1].arguments + d.arguments)
        elif d.id is not None or d.arguments:
            out.append(d)
    return out
