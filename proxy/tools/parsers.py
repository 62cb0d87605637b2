"""Incremental tool-call parsers for the ``tool_choice: "auto"`` path.

A parser sees the detokenized output of one choice, piece by piece, and splits it into *content*
(text for ``delta.content`` / ``message.content``) and *tool calls* (OpenAI ``tool_calls``). The
formats and names follow vLLM's ``--tool-call-parser`` options:

- ``hermes`` (Hermes 2/3, Qwen2/2.5/3 templates): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  repeated for parallel calls; text may come before and between calls.
- ``llama3_json`` (Llama 3.1/3.2/3.3 templates): the whole output is one or more
  ``{"name": ..., "parameters": {...}}`` objects separated by ``;`` (optionally after
  ``<|python_tag|>``); output that does not start with ``{`` is plain content.
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}`` objects, or the
  v11+ form ``[TOOL_CALLS]name[ARGS]{...}`` (repeated). The marker is a special token in Mistral
  tokenizers, so the API must detokenize with that token kept (``marker_text``).

Rules shared by all formats, and why:

- **No partial marker leaks into content**: text that could be the start of a marker is held back
  until it is known not to be one (the stop-string hold-back rule of ``proxy.hotpath.StopChecker``).
- **Whitespace around calls is not content**: trailing whitespace is held; it is emitted when more
  text follows, dropped when a call follows; whitespace right after a call is dropped. Output with a
  call and only whitespace besides has ``content`` null, as vLLM's parsers answer.
- **Invalid calls are content**: a marker whose payload is not valid JSON of the expected shape is
  returned as content text, marker included, never an error (vLLM does the same).
- **Streaming == non-streaming**: :meth:`ToolCallParser.parse` is ``feed`` + ``flush``, so the
  concatenated stream always equals the one-shot result, whatever the chunking.

Calls are emitted whole, once their closing marker (or the end of output) is seen: one header delta
(``index``, ``id``, ``type``, ``function.name``) then one ``function.arguments`` delta with the full
JSON text, which is what OpenAI's streaming shape allows (argument fragments concatenate to the JSON).
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "PARSERS",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolParseResult",
    "detect_parser",
    "get_parser",
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
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


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


def _call_of(obj: Any, arg_keys: tuple[str, ...]) -> tuple[str, str] | None:
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
    values = []
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


def _parse_hermes(payload: str) -> list[tuple[str, str]] | None:
    values = _json_values(payload, "")
    if not values:
        return None
    objs = values[0] if len(values) == 1 and isinstance(values[0], list) else values
    calls = [_call_of(o, ("arguments", "parameters")) for o in objs]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


def _parse_llama3(payload: str) -> list[tuple[str, str]] | None:
    values = _json_values(payload, ";")
    if not values:
        return None
    calls = [_call_of(o, ("parameters", "arguments")) for o in values]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def _parse_mistral(payload: str) -> list[tuple[str, str]] | None:
    text = payload.strip()
    if text.startswith(("[", "{")):
        values = _json_values(text, "")
        if values is None or len(values) != 1:
            return None
        objs = values[0] if isinstance(values[0], list) else [values[0]]
        calls = [_call_of(o, ("arguments", "parameters")) for o in objs]
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


@dataclass(frozen=True)
class _Format:
    name: str
    start: str  # the marker that opens the call section
    end: str | None  # closes one call; None: the calls run to the end of the output
    parse: Callable[[str], list[tuple[str, str]] | None]
    at_start_only: bool = False  # llama3_json: calls only when the output starts with them
    alt_start: str | None = None  # llama3_json: "{" also opens (and is kept in the payload)


_FORMATS = {
    "hermes": _Format("hermes", "<tool_call>", "</tool_call>", _parse_hermes),
    "llama3_json": _Format("llama3_json", "<|python_tag|>", None, _parse_llama3, True, "{"),
    "mistral": _Format("mistral", "[TOOL_CALLS]", None, _parse_mistral),
}

PARSERS: tuple[str, ...] = tuple(_FORMATS)
"""Parser names accepted by ``--tool-call-parser`` (vLLM's names)."""


def _held_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallParser:
    """Incremental parser for one choice's output (one instance per choice).

    Args:
        name: one of :data:`PARSERS`.

    Raises:
        ValueError: unknown parser name.
    """

    def __init__(self, name: str) -> None:
        if name not in _FORMATS:
            raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(PARSERS)}")
        self.format = _FORMATS[name]
        self.tool_calls: list[ToolCall] = []
        self._buf = ""
        self._in_call = False
        self._held_ws = ""
        self._after_call = False
        self._start_decided = not self.format.at_start_only
        self._content: list[str] = []
        self._raw_start = ""  # the marker text that opened the current call (for invalid payloads)

    @property
    def marker_text(self) -> str:
        """The marker that opens tool calls (the API keeps it when it is a special token)."""
        return self.format.start

    # ---- content ----------------------------------------------------------------------------------

    def _emit(self, text: str, out: list[str]) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body):]
        if body:
            out.append(body)
            self._content.append(body)

    def _add_calls(self, calls: list[tuple[str, str]], deltas: list[ToolCallDelta]) -> None:
        self._held_ws = ""
        for name, args in calls:
            call = ToolCall(new_call_id(), name, args)
            deltas.extend(call_deltas(len(self.tool_calls), call))
            self.tool_calls.append(call)
        self._after_call = True

    # ---- streaming ---------------------------------------------------------------------------------

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Consume the next piece of output text.

        Returns:
            ``(content, deltas)``: content text safe to show now, and tool-call deltas completed by
            this piece (in call order; indices count from 0 over the whole output).
        """
        fmt = self.format
        self._buf += text
        out: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if not self._start_decided:
                body = self._buf.lstrip()
                if not body or fmt.start.startswith(body):
                    break  # whitespace or a partial <|python_tag|>: undecided
                self._start_decided = True
                if body.startswith(fmt.start):
                    self._buf, self._raw_start, self._in_call = body[len(fmt.start):], fmt.start, True
                elif fmt.alt_start is not None and body.startswith(fmt.alt_start):
                    self._buf, self._raw_start, self._in_call = body, "", True
                else:
                    self._emit(self._buf, out)
                    self._buf = ""
                    break
            if self._in_call:
                if fmt.end is None:
                    break  # the calls run to the end of the output
                idx = self._buf.find(fmt.end)
                if idx < 0:
                    break
                payload, self._buf = self._buf[:idx], self._buf[idx + len(fmt.end):]
                self._close_call(payload, fmt.end, out, deltas)
                continue
            if fmt.at_start_only:
                self._emit(self._buf, out)  # calls only at the start: the rest is content
                self._buf = ""
                break
            idx = self._buf.find(fmt.start)
            if idx >= 0:
                if idx:
                    self._emit(self._buf[:idx], out)
                self._held_ws = ""
                self._buf, self._raw_start, self._in_call = self._buf[idx + len(fmt.start):], fmt.start, True
                continue
            keep = _held_prefix_len(self._buf, fmt.start)
            if len(self._buf) > keep:
                self._emit(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
            break
        return "".join(out), deltas

    def _close_call(self, payload: str, end: str, out: list[str], deltas: list[ToolCallDelta]) -> None:
        self._in_call = False
        calls = self.format.parse(payload)
        if calls is None:
            self._after_call = False
            self._emit(self._raw_start + payload + end, out)
        else:
            self._add_calls(calls, deltas)

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: settle what is held back (an unclosed call is parsed as if closed)."""
        out: list[str] = []
        deltas: list[ToolCallDelta] = []
        if self._in_call:
            self._close_call(self._buf, "", out, deltas)
        elif self._buf:
            self._emit(self._buf, out)
        self._buf = ""
        if self._held_ws and not self.tool_calls:
            out.append(self._held_ws)
            self._content.append(self._held_ws)
        self._held_ws = ""
        return "".join(out), deltas

    # ---- one shot ----------------------------------------------------------------------------------

    def parse(self, text: str) -> ToolParseResult:
        """Parse a whole output (the non-stream path): exactly ``feed(text)`` then ``flush()``."""
        self.feed(text)
        self.flush()
        content = "".join(self._content)
        return ToolParseResult(content if content else None, list(self.tool_calls))


def get_parser(name: str) -> ToolCallParser:
    """A new parser by vLLM name (``hermes``, ``llama3_json``, ``mistral``).

    Raises:
        ValueError: unknown name.
    """
    return ToolCallParser(name)


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
