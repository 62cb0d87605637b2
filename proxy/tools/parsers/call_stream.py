"""Tool calls read out of JSON text while it is generated, their arguments streamed as fragments.

:class:`CallStream` is the streaming reader behind every format: the calls after a tool-call marker
(``auto``) and the whole grammar-constrained output of ``tool_choice: "required"`` or a named
function. It tracks JSON strings and nesting character by character, so each call's header goes out
as soon as its name is known and its arguments follow piece by piece, as the model writes them.
"""

from __future__ import annotations

import json
import re

from proxy.tools.parsers.calls import PendingCall, ToolCallDelta, coalesce_deltas
from proxy.tools.parsers.payloads import call_of

__all__ = ["CallStream"]

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
        return coalesce_deltas(out)

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
            call = call_of(json.loads(text), ("arguments", "parameters"))
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
