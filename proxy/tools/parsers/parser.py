"""The ``tool_choice: "auto"`` parser of one choice: output text -> content + tool calls, incrementally.

:class:`ToolCallParser` finds a format's markers (:mod:`proxy.tools.parsers.formats`) in the
streamed text, holds back what could be the start of a marker, passes the text after a marker to a
:class:`~proxy.tools.parsers.call_stream.CallStream`, and settles sections that never streamed a
call with the format's whole-section parser. The rules it keeps are the package's (see
:mod:`proxy.tools.parsers`).
"""

from __future__ import annotations

from proxy.tools.parsers.call_stream import CallStream
from proxy.tools.parsers.calls import (
    PendingCall,
    ToolCall,
    ToolCallDelta,
    ToolParseResult,
    call_deltas,
    coalesce_deltas,
)
from proxy.tools.parsers.formats import FORMATS, PARSERS

__all__ = ["ToolCallParser", "get_parser"]


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
        if name not in FORMATS:
            raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(PARSERS)}")
        self.format = FORMATS[name]
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
        return "".join(out), coalesce_deltas(deltas)

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
        return "".join(out), coalesce_deltas(deltas)

    # ---- one shot ----------------------------------------------------------------------------------

    def parse(self, text: str) -> ToolParseResult:
        """Parse a whole output (the non-stream path): exactly ``feed(text)`` then ``flush()``."""
        self.feed(text)
        self.flush()
        content = "".join(self._content)
        return ToolParseResult(content if content else None, self.tool_calls)


def get_parser(name: str) -> ToolCallParser:
    """A new parser by vLLM name (``hermes``, ``llama3_json``, ``mistral``).

    Raises:
        ValueError: unknown name.
    """
    return ToolCallParser(name)
