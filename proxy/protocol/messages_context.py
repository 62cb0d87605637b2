"""Anthropic context editing (``context_management``, beta ``context-management-2025-06-27``): the edits
validated, and applied to a Messages body's ``messages`` before it is translated and templated.

Anthropic "Context editing" and the SDK's types (``BetaClearToolUses20250919EditParam``,
``BetaClearThinking20251015EditParam``) define two server-side edits, applied in the order given:

- ``clear_tool_uses_20250919``: once ``trigger`` is passed (``{type: "input_tokens", value}``: the
  prompt has more tokens than ``value``, default 100000; ``{type: "tool_uses", value}``: the
  conversation has more tool uses), the tool results of the oldest tool uses are replaced by
  :data:`CLEARED_TOOL_RESULT`, all but the most recent ``keep`` (``{type: "tool_uses", value}``,
  default 3) and those of the tools named in ``exclude_tools``; ``clear_tool_inputs`` (``true``, or a
  list of tool names) also empties the cleared calls' ``input`` (to ``{}``). With ``clear_at_least``
  (``{type: "input_tokens", value}``) the edit applies only if it clears at least that many tokens.
- ``clear_thinking_20251015``: the ``thinking`` / ``redacted_thinking`` blocks of all assistant
  messages but the last ``keep`` that have some (``{type: "thinking_turns", value}``, default 1) are
  removed; ``keep: "all"`` (or ``{type: "all"}``) keeps them all (what Claude Code sends).

Choices where the docs leave it open (docs/api.md says so): a "turn" is one assistant message; the
placeholder text (Anthropic does not publish its own); tokens are this server's prompt tokens. The
edit types this server cannot run (``compact_20260112``: a summary written by the model) and unknown
ones are a 400 naming ``context_management.edits[i].type``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from .fields import _bad, _type_name, array_of_objects

__all__ = ["CLEARED_TOOL_RESULT", "ClearThinking", "ClearToolUses", "ContextEdit", "clear_thinking",
           "clear_tool_uses", "num_tool_uses", "parse_context_management"]

CLEARED_TOOL_RESULT = "[cleared]"
"""What a cleared tool result's content becomes (the placeholder LangChain's mirror of this edit uses)."""


@dataclass(frozen=True)
class ClearToolUses:
    """A validated ``clear_tool_uses_20250919`` edit (fields as in the module docstring)."""

    trigger_type: str = "input_tokens"
    trigger_value: int = 100_000
    keep: int = 3
    clear_at_least: int = 0
    exclude_tools: frozenset[str] = frozenset()
    clear_tool_inputs: bool | frozenset[str] = False
    type: str = "clear_tool_uses_20250919"


@dataclass(frozen=True)
class ClearThinking:
    """A validated ``clear_thinking_20251015`` edit; ``keep`` None: keep all."""

    keep: int | None = 1
    type: str = "clear_thinking_20251015"


ContextEdit = ClearToolUses | ClearThinking


def _count(value: Any, path: str, kinds: tuple[str, ...], lo: int) -> tuple[str, int]:
    """A ``{type, value}`` object -> (type, value); 400 naming ``path`` when malformed."""
    if not isinstance(value, dict):
        raise _bad(path, f"'{path}' must be an object, not {_type_name(value)}.")
    kind, number = value.get("type"), value.get("value")
    if kind not in kinds:
        raise _bad(f"{path}.type", f"'{path}.type' must be one of {', '.join(kinds)}; got {kind!r}.")
    if isinstance(number, bool) or not isinstance(number, int) or number < lo:
        raise _bad(f"{path}.value", f"'{path}.value' must be an integer of at least {lo}.")
    return kind, number


def _names(value: Any, path: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad(path, f"'{path}' must be an array of tool names.")
    return frozenset(value)


def _clear_tool_uses(edit: dict[str, Any], path: str) -> ClearToolUses:
    out = ClearToolUses()
    if edit.get("trigger") is not None:
        kind, value = _count(edit["trigger"], f"{path}.trigger", ("input_tokens", "tool_uses"), 1)
        out = ClearToolUses(kind, value)
    keep = out.keep
    if edit.get("keep") is not None:
        keep = _count(edit["keep"], f"{path}.keep", ("tool_uses",), 0)[1]
    least = edit.get("clear_at_least")
    least_value = 0 if least is None else _count(least, f"{path}.clear_at_least", ("input_tokens",), 0)[1]
    exclude = frozenset() if edit.get("exclude_tools") is None else _names(edit["exclude_tools"],
                                                                           f"{path}.exclude_tools")
    inputs = edit.get("clear_tool_inputs")
    clear_inputs: bool | frozenset[str] = False
    if isinstance(inputs, bool):
        clear_inputs = inputs
    elif inputs is not None:
        clear_inputs = _names(inputs, f"{path}.clear_tool_inputs")
    return ClearToolUses(out.trigger_type, out.trigger_value, keep, least_value, exclude, clear_inputs)


def _clear_thinking(edit: dict[str, Any], path: str) -> ClearThinking:
    keep = edit.get("keep")
    if keep is None:
        return ClearThinking()
    if keep == "all" or (isinstance(keep, dict) and keep.get("type") == "all"):
        return ClearThinking(None)
    return ClearThinking(_count(keep, f"{path}.keep", ("thinking_turns", "all"), 1)[1])


def parse_context_management(value: Any) -> tuple[ContextEdit, ...]:
    """``context_management`` -> its edits in order (``()`` when absent or without edits).

    Raises:
        InvalidRequestError: a malformed edit, or an edit type this server cannot apply, naming the
            field (``context_management.edits[1].keep.value``).
    """
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _bad("context_management", f"'context_management' must be an object, not {_type_name(value)}.")
    edits = value.get("edits")
    if edits is None:
        return ()
    out: list[ContextEdit] = []
    for path, edit in array_of_objects(edits, "context_management.edits"):
        kind = edit.get("type")
        if kind == "clear_tool_uses_20250919":
            out.append(_clear_tool_uses(edit, path))
        elif kind == "clear_thinking_20251015":
            out.append(_clear_thinking(edit, path))
        else:
            raise _bad(f"{path}.type", f"Context edit type {kind!r} is not supported by this server; "
                       "clear_tool_uses_20250919 and clear_thinking_20251015 are.")
    return tuple(out)


def _blocks(message: Any) -> list[Any]:
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, list) else []


def _tool_uses(messages: list[Any]) -> list[tuple[int, int, dict[str, Any]]]:
    """``(message index, block index, block)`` of every ``tool_use`` of the assistant, in order."""
    return [(i, j, b) for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"
            for j, b in enumerate(_blocks(m)) if isinstance(b, dict) and b.get("type") == "tool_use"]


def num_tool_uses(messages: list[Any]) -> int:
    """How many ``tool_use`` blocks the assistant messages hold (a ``tool_uses`` trigger's count)."""
    return len(_tool_uses(messages))


def clear_tool_uses(messages: list[Any], edit: ClearToolUses) -> tuple[list[Any], int]:
    """``(edited copy of messages, number of tool uses cleared)``; the trigger and ``clear_at_least``
    are the caller's (they need token counts). ``messages`` is left as it is."""
    uses = _tool_uses(messages)
    candidates = uses[:max(0, len(uses) - edit.keep)]
    out = copy.deepcopy(messages)
    cleared = 0
    for i, j, use in candidates:
        name = use.get("name")
        if name in edit.exclude_tools:
            continue
        found = False
        for m in out[i + 1:]:
            for block in _blocks(m):
                if (isinstance(block, dict) and block.get("type") == "tool_result"
                        and block.get("tool_use_id") == use.get("id")
                        and block.get("content") != CLEARED_TOOL_RESULT):
                    block["content"] = CLEARED_TOOL_RESULT
                    found = True
        inputs = edit.clear_tool_inputs
        if inputs is True or (isinstance(inputs, frozenset) and name in inputs):
            found = found or out[i]["content"][j].get("input") != {}
            out[i]["content"][j]["input"] = {}
        cleared += found
    return out, cleared


def clear_thinking(messages: list[Any], keep: int | None) -> tuple[list[Any], int]:
    """``(edited copy of messages, number of assistant messages whose thinking was removed)``: the
    thinking blocks of all but the last ``keep`` assistant messages that have some (None: none)."""
    thinking = ("thinking", "redacted_thinking")
    turns = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"
             and any(isinstance(b, dict) and b.get("type") in thinking for b in _blocks(m))]
    if keep is None or len(turns) <= keep:
        return messages, 0
    out = list(messages)
    for i in turns[:len(turns) - keep]:
        out[i] = {**out[i], "content": [b for b in _blocks(out[i])
                                        if not (isinstance(b, dict) and b.get("type") in thinking)]}
    return out, len(turns) - keep
