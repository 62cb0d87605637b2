"""Incremental tool-call parsers for the ``tool_choice: "auto"`` path.

A parser sees the detokenized output of one choice, piece by piece, and splits it into *content*
(text for ``delta.content`` / ``message.content``) and *tool calls* (OpenAI ``tool_calls``). The
formats and names follow vLLM's ``--tool-call-parser`` options:

- ``hermes`` (Hermes 2/3, Qwen2/2.5/3 templates):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated for parallel calls; text may
  come before and between calls.
- ``llama3_json`` (Llama 3.1/3.2/3.3 templates): the whole output is one or more
  ``{"name": ..., "parameters": {...}}`` objects separated by ``;`` (optionally after
  ``<|python_tag|>``); output that does not start with ``{`` is plain content.
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}`` objects, or the
  v11+ form ``[TOOL_CALLS]name[ARGS]{...}`` (repeated). The markers are special tokens in Mistral
  tokenizers, so the API detokenizes with them kept (``marker_texts``).

Rules shared by all formats, and why:

- **No partial marker leaks into content**: text that could be the start of a marker is held back
  until it is known not to be one (the stop-string hold-back rule of ``proxy.hotpath.StopChecker``).
- **Whitespace around calls is not content**: trailing whitespace is held; it is emitted when more
  text follows, dropped when a call follows; whitespace right after a call is dropped. Output with a
  call and only whitespace besides has ``content`` null, as vLLM's parsers answer.
- **Invalid calls are content**: a marker whose payload is not a call (not JSON of the expected
  shape) is returned as content text, marker included, never an error (vLLM does the same), as long
  as no call of it was streamed yet (next rule).
- **Arguments stream as they are generated** (:class:`CallStream`): a call is sent as soon as its
  name is known and its arguments object has started (``{"name": "f", "arguments": {``): a header
  delta (``index``, ``id``, ``type``, ``function.name``), then, for each piece of output, one delta
  with the arguments text that piece brought, the model's text unchanged, so the fragments
  concatenate to ``function.arguments`` (OpenAI's streaming shape). A sent call is never taken back:
  if the model then breaks the JSON or ``max_tokens`` cuts it, ``arguments`` is the text up to there
  and may not parse (as with OpenAI when ``max_tokens`` cuts a call). Mistral's ``name[ARGS]{...}``
  streams the same way. Other shapes (arguments before the name, arguments as a JSON string) are
  sent whole when complete, their arguments re-serialized with ``json.dumps``.
- **Streaming == non-streaming**: :meth:`ToolCallParser.parse` is ``feed`` + ``flush``, so the
  concatenated stream always equals the one-shot result, whatever the chunking.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CALL_SHAPES",
    "PARSERS",
    "CallStream",
    "PendingCall",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolParseResult",
    "detect_parser",
    "format_calls",
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


# A call object whose name is known and whose arguments object just opened: stream from here.
_COMMIT = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{\Z')
_SEEK, _OBJECT, _ARGS, _REST, _DONE, _ARGS_ONLY, _NAME, _BEFORE_ARGS = range(8)
_BETWEEN_CALLS = frozenset(" \t\r\n,;[]")


def _committed_name(obj: list[str]) -> str | None:
    m = _COMMIT.match("".join(obj))
    if m is None:
        return None
    try:
        name = json.loads(m.group(1))
    except ValueError:
        return None
    return name if isinstance(name, str) and name else None


def _coalesce(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Merge consecutive arguments fragments of the same call (one delta per call per piece of output)."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and d.id is None and out[-1].id is None and out[-1].index == d.index:
            out[-1] = ToolCallDelta(d.index, None, None, out[-1].arguments + d.arguments)
        elif d.id is not None or d.arguments:
            out.append(d)
    return out


class CallStream:
    """Tool calls out of JSON text while it is generated, their arguments streamed as fragments.

    The text (what follows a tool-call marker, or a whole grammar-constrained output) is a sequence
    of call objects ``{"name": ..., "arguments" | "parameters": {...}}``, optionally inside one array
    and separated by whitespace, ``,`` or ``;``. With ``name`` (a named ``tool_choice``) the text is
    the arguments object of that function itself. With ``name_markers`` (Mistral's
    ``("[TOOL_CALLS]", "[ARGS]")``) calls may also be written ``name[ARGS]{...}``, repeated after
    ``[TOOL_CALLS]``.

    A call is *committed* when its name is known and its arguments object has started: :meth:`feed`
    returns its header delta (``index``, ``id``, ``name``) and then, per call of :meth:`feed`, one
    delta with the arguments text that piece added (the model's text byte for byte, so the fragments
    concatenate to the final ``arguments``). The end of the arguments object is found by tracking
    JSON strings and nesting (not by validating the JSON). A call object of another shape is sent
    whole when it closes (arguments re-serialized). A committed call stays: if the text breaks off,
    its arguments are what came so far. Text that is not a call before any commit sets
    :attr:`failed` (the owner then applies its whole-text rule); after a commit it is ignored.

    Args:
        calls: the owner's list of calls, appended to (indices count over the whole output).
        name: the function of a named ``tool_choice``; None: the text holds call objects.
        name_markers: ``(call marker, arguments marker)`` of the ``name[ARGS]{...}`` form; None: no such form.
    """

    def __init__(self, calls: list[PendingCall], name: str | None = None,
                 name_markers: tuple[str, str] | None = None) -> None:
        self._calls = calls
        self._name = name
        self._name_markers = name_markers
        self._name_text: list[str] = []  # the name[ARGS] form: text before the arguments marker
        self._parts: list[str] = []
        self._object: list[str] = []  # text of the call object before its commit
        self._state = _ARGS_ONLY if name is not None else _SEEK
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._args_depth = 0  # nesting depth inside the arguments object
        self.committed = False
        self.failed = False

    @property
    def text(self) -> str:
        """All text fed so far."""
        return "".join(self._parts)

    def _commit(self, name: str, arguments: str, out: list[ToolCallDelta]) -> PendingCall:
        call = PendingCall(name, arguments)
        self._calls.append(call)
        index = len(self._calls) - 1
        out.append(ToolCallDelta(index, call.id, name, ""))
        if arguments:
            out.append(ToolCallDelta(index, None, None, arguments))
        self.committed = True
        return call

    def feed(self, text: str) -> list[ToolCallDelta]:
        """The next piece of text -> the deltas it completes (headers, one fragment per call)."""
        self._parts.append(text)
        out: list[ToolCallDelta] = []
        frag: list[str] = []  # arguments text of the current call in this piece
        for ch in text:
            state = self._state
            if state == _DONE or self.failed:
                break
            if state == _SEEK or state == _NAME:
                if ch == "{" and not "".join(self._name_text).strip(" \t\r\n,;[]"):
                    self._state, self._object, self._depth = _OBJECT, ["{"], 1
                    self._in_string = self._escape = False
                    self._name_text = []
                elif self._name_markers is not None and (state == _NAME or not ch.isspace()):
                    self._state = _NAME
                    self._name_text.append(ch)
                    self._name_form(out)
                elif ch not in _BETWEEN_CALLS and not self.committed:
                    self.failed = True
                continue
            if state == _BEFORE_ARGS:
                if ch == "{":
                    self._commit(self._name_text.pop(), "", out)
                    self._state, self._depth, self._args_depth = _ARGS, 1, 1
                    self._in_string = self._escape = False
                    frag.append(ch)
                elif not ch.isspace():
                    self._not_a_call()
                continue
            if state == _ARGS_ONLY:
                if ch == "{":
                    self._commit(self._name or "", "", out)
                    self._state, self._depth, self._args_depth = _ARGS, 1, 1
                    frag.append(ch)
                elif not ch.isspace():
                    self.failed = True
                continue
            # JSON strings and nesting
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                opened = closed = False
            else:
                opened = ch in "{["
                closed = ch in "}]"
                if ch == '"':
                    self._in_string = True
                elif opened:
                    self._depth += 1
                elif closed:
                    self._depth -= 1
            if state == _ARGS:
                frag.append(ch)
                if closed and self._depth == self._args_depth - 1:
                    self._flush_frag(frag, out)
                    self._state = _REST if self._depth > 0 else _DONE if self._name is not None else _SEEK
            elif state == _OBJECT:
                self._object.append(ch)
                if opened and ch == "{" and self._depth == 2 and (name := _committed_name(self._object)):
                    self._commit(name, "", out)
                    self._state, self._args_depth = _ARGS, 2
                    frag.append(ch)
                elif closed and self._depth == 0:
                    self._whole_object("".join(self._object), out)
            elif closed and self._depth == 0:  # _REST: the rest of a committed call object
                self._state = _SEEK
        self._flush_frag(frag, out)
        return _coalesce(out)

    def _not_a_call(self) -> None:
        self._state, self._name_text = _SEEK, []
        if not self.committed:
            self.failed = True

    def _name_form(self, out: list[ToolCallDelta]) -> None:
        """``name[ARGS]``: once the arguments marker is complete, the name is known."""
        assert self._name_markers is not None
        call_marker, args_marker = self._name_markers
        text = "".join(self._name_text)
        if not text.endswith(args_marker):
            if len(text) > 256 and args_marker not in text:
                self._not_a_call()
            return
        name = text[: -len(args_marker)].split(call_marker)[-1].strip()
        if not name or any(c.isspace() or c in '{}[]"' for c in name):
            self._not_a_call()
            return
        self._state, self._name_text = _BEFORE_ARGS, [name]

    def _flush_frag(self, frag: list[str], out: list[ToolCallDelta]) -> None:
        if frag:
            text = "".join(frag)
            frag.clear()
            self._calls[-1].parts.append(text)
            out.append(ToolCallDelta(len(self._calls) - 1, None, None, text))

    def _whole_object(self, text: str, out: list[ToolCallDelta]) -> None:
        self._state = _SEEK
        try:
            call = _call_of(json.loads(text), ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is not None:
            self._commit(call[0], call[1], out)
        elif not self.committed:
            self.failed = True

    @property
    def in_arguments(self) -> bool:
        """True while a committed call's arguments object is still open (the text was cut there)."""
        return self._state == _ARGS


@dataclass(frozen=True)
class _Format:
    name: str
    start: str  # the marker that opens the call section
    end: str | None  # closes one call; None: the calls run to the end of the output
    parse: Callable[[str], list[tuple[str, str]] | None]
    at_start_only: bool = False  # llama3_json: calls only when the output starts with them
    alt_start: str | None = None  # llama3_json: "{" also opens (and is kept in the payload)
    markers: tuple[str, ...] = ()  # every marker the parser reads (special tokens in some vocabularies)
    name_markers: tuple[str, str] | None = None  # mistral v11: [TOOL_CALLS]name[ARGS]{...}


_FORMATS = {
    "hermes": _Format("hermes", "<tool_call>", "</tool_call>", _parse_hermes,
                      markers=("<tool_call>", "</tool_call>")),
    "llama3_json": _Format("llama3_json", "<|python_tag|>", None, _parse_llama3, True, "{",
                           ("<|python_tag|>",)),
    "mistral": _Format("mistral", "[TOOL_CALLS]", None, _parse_mistral, markers=("[TOOL_CALLS]", "[ARGS]"),
                       name_markers=("[TOOL_CALLS]", "[ARGS]")),
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
        self._calls: list[PendingCall] = []
        self._buf = ""
        self._in_call = False
        self._section: CallStream | None = None  # the calls after the current marker
        self._held_ws = ""
        self._after_call = False
        self._start_decided = not self.format.at_start_only
        self._content: list[str] = []
        self._raw_start = ""  # the marker text that opened the current call (for invalid payloads)

    @property
    def marker_text(self) -> str:
        """The marker that opens tool calls."""
        return self.format.start

    @property
    def marker_texts(self) -> tuple[str, ...]:
        """Every marker this format uses; where the vocabulary has one as a special token (Mistral's
        ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``) the API keeps it in the output text for the
        parser (``SamplingParams.keep_special_ids``), since the detokenizer drops special tokens."""
        return self.format.markers

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls so far (the last one's arguments still growing while it streams)."""
        return [c.to_call() for c in self._calls]

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
            call = PendingCall(name, args)
            deltas.extend(call_deltas(len(self._calls), call.to_call()))
            self._calls.append(call)
        self._after_call = True

    def _open_call(self, rest: str, raw_start: str) -> None:
        self._buf, self._raw_start, self._in_call = rest, raw_start, True
        self._section = CallStream(self._calls, name_markers=self.format.name_markers)

    # ---- streaming ---------------------------------------------------------------------------------

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Consume the next piece of output text.

        Returns:
            ``(content, deltas)``: content text safe to show now, and tool-call deltas (headers and
            arguments fragments, in call order; indices count from 0 over the whole output).
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
                    self._open_call(body[len(fmt.start):], fmt.start)
                elif fmt.alt_start is not None and body.startswith(fmt.alt_start):
                    self._open_call(body, "")
                else:
                    self._emit(self._buf, out)
                    self._buf = ""
                    break
            if self._in_call:
                assert self._section is not None
                idx = self._buf.find(fmt.end) if fmt.end is not None else -1
                if idx < 0:  # the call goes on: pass on all but a possible partial end marker
                    keep = _held_prefix_len(self._buf, fmt.end) if fmt.end is not None else 0
                    if len(self._buf) > keep:
                        deltas += self._section.feed(self._buf[: len(self._buf) - keep])
                        self._buf = self._buf[len(self._buf) - keep:]
                    break
                deltas += self._section.feed(self._buf[:idx])
                self._buf = self._buf[idx + len(fmt.end or ""):]
                self._close_call(fmt.end or "", out, deltas)
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
                self._open_call(self._buf[idx + len(fmt.start):], fmt.start)
                continue
            keep = _held_prefix_len(self._buf, fmt.start)
            if len(self._buf) > keep:
                self._emit(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
            break
        return "".join(out), _coalesce(deltas)

    def _close_call(self, end: str, out: list[str], deltas: list[ToolCallDelta]) -> None:
        """The current call section ended (its end marker or the end of output)."""
        section = self._section
        assert section is not None
        self._in_call, self._section = False, None
        if section.committed:  # its calls were streamed
            self._held_ws = ""
            self._after_call = True
            return
        payload = section.text
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
            assert self._section is not None
            deltas += self._section.feed(self._buf)
            self._buf = ""
            self._close_call("", out, deltas)
        elif self._buf:
            self._emit(self._buf, out)
        self._buf = ""
        if self._held_ws and not self._calls:
            out.append(self._held_ws)
            self._content.append(self._held_ws)
        self._held_ws = ""
        return "".join(out), _coalesce(deltas)

    # ---- one shot ----------------------------------------------------------------------------------

    def parse(self, text: str) -> ToolParseResult:
        """Parse a whole output (the non-stream path): exactly ``feed(text)`` then ``flush()``."""
        self.feed(text)
        self.flush()
        content = "".join(self._content)
        return ToolParseResult(content if content else None, self.tool_calls)


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
    if name not in _FORMATS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(PARSERS)}")
    if name == "hermes":
        return "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False)
                         + "\n</tool_call>" for n, a in calls)
    if name == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


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
