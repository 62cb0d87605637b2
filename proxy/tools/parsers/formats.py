"""The tool-call formats of chat templates: how each marks, is read, is written and is recognized.

One :class:`CallFormat` per vLLM ``--tool-call-parser`` name (:data:`PARSERS`): its markers and its
whole-section parser (:mod:`proxy.tools.parsers.payloads`), which :class:`~proxy.tools.ToolCallParser`
drives; :data:`CALL_SHAPES` and :func:`format_calls` write calls in a format (for prompts and
earlier turns on a template without tool support); :func:`detect_parser` picks a format from a chat
template's text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.tools.parsers.payloads import parse_hermes, parse_llama3, parse_mistral

__all__ = ["CALL_SHAPES", "FORMATS", "PARSERS", "CallFormat", "detect_parser", "format_calls"]


@dataclass(frozen=True)
class CallFormat:
    """One tool-call format: its markers and how a complete call section is parsed."""

    name: str
    start: str  # the marker that opens the call section
    end: str | None  # closes one call; None: the calls run to the end of the output
    parse: Callable[[str], list[tuple[str, str]] | None]
    at_start_only: bool = False  # llama3_json: calls only when the output starts with them
    alt_start: str | None = None  # llama3_json: "{" also opens (and is kept in the payload)
    markers: tuple[str, ...] = ()  # every marker the parser reads (special tokens in some vocabularies)
    name_markers: tuple[str, str] | None = None  # mistral v11: [TOOL_CALLS]name[ARGS]{...}


FORMATS: dict[str, CallFormat] = {
    "hermes": CallFormat("hermes", "<tool_call>", "</tool_call>", parse_hermes,
                         markers=("<tool_call>", "</tool_call>")),
    "llama3_json": CallFormat("llama3_json", "<|python_tag|>", None, parse_llama3, True, "{",
                              ("<|python_tag|>",)),
    "mistral": CallFormat("mistral", "[TOOL_CALLS]", None, parse_mistral,
                          markers=("[TOOL_CALLS]", "[ARGS]"), name_markers=("[TOOL_CALLS]", "[ARGS]")),
}
"""The formats by parser name."""

PARSERS: tuple[str, ...] = tuple(FORMATS)
"""Parser names accepted by ``--tool-call-parser`` (vLLM's names)."""


CALL_SHAPES: dict[str, str] = {
    "hermes": '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>',
    "llama3_json": '{"name": <function name>, "parameters": <arguments object>}',
    "mistral": '[TOOL_CALLS][{"name": <function name>, "arguments": <arguments object>}]',
}
"""Per parser, how one call is written, with placeholders (for prompts that teach a format)."""


def format_calls(name: str, calls: list[tuple[str, Any]]) -> str:
    """Calls ``(function name, arguments object)`` written in parser ``name``'s format, as the parser
    reads them back (earlier turns of a conversation, shown to a model that was taught the format).

    Raises:
        ValueError: unknown parser name.
    """
    if name not in FORMATS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(PARSERS)}")
    if name == "hermes":
        return "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False)
                         + "\n</tool_call>" for n, a in calls)
    if name == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool format needs, or None when the template has no tool support.

    Looks for each format's marker in the template text (the templates print it when they render
    tool calls of earlier turns or describe the format to the model).
    """
    if not chat_template or "tools" not in chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or ("ipython" in chat_template and "parameters" in chat_template):
        return "llama3_json"
    return None
