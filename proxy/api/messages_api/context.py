"""Apply a Messages request's ``context_management`` edits (rules in :mod:`proxy.protocol.messages_context`):
each edit in order edits the body's ``messages``, the body is parsed again and its prompt counted, and
the edit is reported in ``context_management.applied_edits`` with the tokens it cleared."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.protocol.messages_context import ClearThinking, clear_thinking, clear_tool_uses, num_tool_uses
from proxy.protocol.messages_request import MessagesRequest


@dataclass
class ManagedContext:
    """The outcome of the edits.

    Attributes:
        request: the request as edited (the one to generate or count).
        applied_edits: Anthropic's ``applied_edits`` entries (``type``, ``cleared_tool_uses`` or
            ``cleared_thinking_turns``, ``cleared_input_tokens``), one per edit that cleared something.
        original_input_tokens: the unedited prompt's length (``count_tokens`` reports it), None when
            it was not needed (nothing to clear).
    """

    request: MessagesRequest
    applied_edits: list[dict[str, Any]] = field(default_factory=list)
    original_input_tokens: int | None = None

    def response_field(self) -> dict[str, Any] | None:
        """The response's ``context_management`` (None when the request had no edits)."""
        return {"applied_edits": self.applied_edits} if self.request.context_edits else None


async def manage_context(request: MessagesRequest, reparse: Callable[[dict[str, Any]], MessagesRequest],
                         count: Callable[[MessagesRequest], Awaitable[int]]) -> ManagedContext:
    """Apply ``request.context_edits``.

    Args:
        request: the parsed request.
        reparse: a body -> its parsed request (as the route parses).
        count: a parsed request -> its prompt's token count (as it would be generated).

    Raises:
        InvalidRequestError: what ``reparse`` or ``count`` raise.
    """
    out = ManagedContext(request)
    if not request.context_edits or not isinstance(request.body.get("messages"), list):
        return out
    messages: list[Any] = request.body["messages"]
    num_tokens: int | None = None
    for edit in request.context_edits:
        if isinstance(edit, ClearThinking):
            edited, num_cleared = clear_thinking(messages, edit.keep)
            report = {"type": edit.type, "cleared_thinking_turns": num_cleared}
        else:
            if edit.trigger_type == "tool_uses":
                if num_tool_uses(messages) <= edit.trigger_value:
                    continue
            else:
                num_tokens = num_tokens if num_tokens is not None else await count(out.request)
                out.original_input_tokens = out.original_input_tokens or num_tokens
                if num_tokens <= edit.trigger_value:
                    continue
            edited, num_cleared = clear_tool_uses(messages, edit)
            report = {"type": edit.type, "cleared_tool_uses": num_cleared}
        if not num_cleared:
            continue
        if num_tokens is None:
            num_tokens = out.original_input_tokens = await count(out.request)
        candidate = reparse({**request.body, "messages": edited})
        num_after = await count(candidate)
        num_freed = num_tokens - num_after
        if not isinstance(edit, ClearThinking) and num_freed < edit.clear_at_least:
            continue
        out.applied_edits.append({**report, "cleared_input_tokens": num_freed})
        out.request, messages, num_tokens = candidate, edited, num_after
    return out
