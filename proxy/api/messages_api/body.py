"""The Anthropic ``message`` object: ``usage``, ``stop_reason`` / ``stop_sequence``, the whole body."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.protocol import Usage


def messages_usage(usage: Usage) -> dict[str, Any]:
    """Anthropic ``usage``: ``input_tokens`` are the prompt tokens NOT read from the prefix cache,
    ``cache_read_input_tokens`` those that were (Anthropic's split: the whole prompt is the sum of
    the two and ``cache_creation_input_tokens``, 0 here: the prefix cache is automatic, no write is
    billed), ``output_tokens`` every generated token (thinking and the EOS included)."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens, "output_tokens": usage.completion_tokens}


def matched_stop(decoded: str, num_visible_chars: int, stop_sequences: tuple[str, ...]) -> str | None:
    """Which of ``stop_sequences`` ended the output, or None (it ended otherwise).

    Args:
        decoded: the generated token ids decoded whole (``Tokenizer.decode``): the visible text, then
            the stop string the stop checker cut off (and what else its last token carried).
        num_visible_chars: the length of the text the client got (the deltas joined).
        stop_sequences: the request's ``stop_sequences``.

    The engine reports only ``finish_reason: "stop"`` (EOS and stop strings alike); the stop string
    is what follows the visible text in the whole decode, the earliest one found there.
    """
    best: tuple[int, str] | None = None
    for seq in stop_sequences:
        at = decoded.find(seq, max(0, num_visible_chars - len(seq) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, seq)
    return best[1] if best is not None else None


def stop_reason(finish_reason: str | None, has_tool_use: bool, stop_sequence: str | None) -> str:
    """Anthropic's ``stop_reason`` of an engine finish reason: ``max_tokens`` (cut at the budget),
    ``stop_sequence`` (one of ``stop_sequences``), ``tool_use`` (the turn ended with tool calls),
    else ``end_turn``."""
    if finish_reason == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if has_tool_use else "end_turn"


@dataclass(frozen=True)
class MessageHead:
    """What names one message: ``id`` (``msg_...``) and ``model``; and ``context_management`` (the
    applied context edits) when the request had edits, sent on the final message."""

    id: str
    model: str
    context_management: dict[str, Any] | None = None


def message_object(head: MessageHead, content: list[dict[str, Any]], usage: dict[str, Any],
                   reason: str | None = None, stop_sequence: str | None = None) -> dict[str, Any]:
    """The whole ``message`` object (Anthropic "Messages" response); ``reason`` None while it streams
    (``message_start``, which carries no ``context_management``: the stream's ``message_delta`` does)."""
    body = {"id": head.id, "type": "message", "role": "assistant", "model": head.model, "content": content,
            "stop_reason": reason, "stop_sequence": stop_sequence, "usage": usage}
    if reason is not None and head.context_management is not None:
        body["context_management"] = head.context_management
    return body
