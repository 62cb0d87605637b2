"""Whole call sections -> calls, one function per format: the payload after a tool-call marker.

Each ``parse_*`` takes the text of one complete call section (what follows the marker, up to its
end marker or the end of the output) and returns its calls as ``(name, arguments JSON text)``
pairs, or None when the payload is not calls of that format's shape (the parser then returns it as
content, marker included, as vLLM's parsers do). Arguments are re-serialized with ``json.dumps``.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["call_of", "parse_hermes", "parse_llama3", "parse_mistral"]


def _arguments_text(value: Any) -> str | None:
    """Arguments as compact JSON text of an object; None if ``value`` is not an object (or its JSON text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def call_of(obj: Any, arg_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """``(name, arguments JSON text)`` of a call object ``{"name", <one of arg_keys>: {...}}``, or None
    when ``obj`` is not one (no non-empty string name, arguments not an object or its JSON text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in arg_keys:
        if key in obj:
            args = obj[key]
            break
    text = _arguments_text(args)
    return None if text is None else (obj["name"], text)


def _json_values(text: str, separators: str) -> list[Any] | None:
    """Consecutive JSON values in ``text`` separated by whitespace or ``separators``; None if invalid."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    pos, n = 0, len(text)
    while True:
        while pos < n and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= n:
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


def parse_hermes(payload: str) -> list[tuple[str, str]] | None:
    """``hermes``: the JSON between ``<tool_call>`` and ``</tool_call>``: one call object, several,
    or one array of them (``arguments``, or ``parameters`` as some models write)."""
    values = _json_values(payload, "")
    if not values:
        return None
    objs = values[0] if len(values) == 1 and isinstance(values[0], list) else values
    calls = [call_of(o, ("arguments", "parameters")) for o in objs]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


def parse_llama3(payload: str) -> list[tuple[str, str]] | None:
    """``llama3_json``: call objects ``{"name", "parameters"}`` separated by ``;`` or whitespace
    (``arguments`` accepted too)."""
    values = _json_values(payload, ";")
    if not values:
        return None
    calls = [call_of(o, ("parameters", "arguments")) for o in values]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def parse_mistral(payload: str) -> list[tuple[str, str]] | None:
    """``mistral``: after ``[TOOL_CALLS]``, a JSON array (or one object) of ``{"name", "arguments"}``,
    or the v11+ form ``name[ARGS]{...}``, repeated after further ``[TOOL_CALLS]`` markers."""
    text = payload.strip()
    if text.startswith(("[", "{")):
        values = _json_values(text, "")
        if values is None or len(values) != 1:
            return None
        objs = values[0] if isinstance(values[0], list) else [values[0]]
        calls = [call_of(o, ("arguments", "parameters")) for o in objs]
        return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]
    calls_v11: list[tuple[str, str]] = []
    for segment in text.split("[TOOL_CALLS]"):
        name, sep, args = segment.partition("[ARGS]")
        name = name.strip()
        args_text = _arguments_text(args.strip()) if sep else None
        if not name or args_text is None:
            return None
        calls_v11.append((name, args_text))
    return calls_v11 or None
