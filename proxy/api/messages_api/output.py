"""The content blocks of one Anthropic message, built from the parts of its choice, and their events.

:class:`MessageOutput` is fed the :class:`~proxy.pipeline.ChoiceParts` of the message's one choice
(the same split as chat's and the Responses API's) and keeps Anthropic's content blocks in the order
they come: ``thinking`` (with a ``signature``), ``text``, ``tool_use`` (``toolu_`` ids, ``input`` an
object). Streaming, it also returns each piece's events in the order of Anthropic "Streaming
Messages": ``content_block_start`` -> ``content_block_delta`` (``thinking_delta`` / ``text_delta`` /
``input_json_delta``) ... -> (a thinking block's ``signature_delta``) -> ``content_block_stop``; a
block is closed when a block of another kind (or another tool call) opens, or at
:meth:`MessageOutput.close`. The deltas of a block join exactly to the block of a non-stream
message: ``thinking`` and ``text`` text for text, the ``partial_json`` fragments to the JSON text
whose value is the ``input``.

Each event is ``event: <type>`` + ``data: <compact JSON>`` + a blank line, the strings escaped by the
hot path's ``dumps`` (``json.dumps(ensure_ascii=False)``).
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from proxy.hotpath import dumps
from proxy.pipeline import ChoiceParts
from proxy.tools.parsers import ToolCallDelta

TOOL_ID_PREFIX = "toolu_"


def sse_event(type: str, fields: dict[str, Any]) -> bytes:
    """One SSE event: ``event: <type>`` and ``data: {"type": <type>, ...fields}`` (Anthropic's framing)."""
    return f"event: {type}\ndata: {dumps({'type': type, **fields})}\n\n".encode()


PING = sse_event("ping", {})
"""The keep-alive event Anthropic sends (``event: ping``); SDKs skip it."""


def signature(thinking: str) -> str:
    """The ``signature`` of a thinking block: base64 of the SHA-256 of its UTF-8 text. Anthropic's is
    opaque to clients and checked by its servers when the block is sent back; here it is only
    deterministic (the same thinking has the same signature, streamed or not) and not checked."""
    return base64.b64encode(hashlib.sha256(thinking.encode("utf-8")).digest()).decode()


def tool_use_id(call_id: str) -> str:
    """The ``toolu_`` id of a tool call of the pipeline (``call_<24 alphanumerics>`` -> ``toolu_<same>``)."""
    return TOOL_ID_PREFIX + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's ``input`` object from its JSON arguments text; ``{}`` when the text is not a JSON
    object (a call cut by ``max_tokens``: its streamed ``partial_json`` still carries what came)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageOutput:
    """The content blocks of one message, and (``stream``) their events.

    Args:
        stream: build the stream events.
        omit_thinking: thinking blocks carry their ``signature`` and no text, and no
            ``thinking_delta`` is streamed (``thinking.display: "omitted"``).

    Attributes:
        content: the blocks so far, in Anthropic's non-stream shapes.
    """

    def __init__(self, stream: bool, omit_thinking: bool = False) -> None:
        self.content: list[dict[str, Any]] = []
        self._stream = stream
        self._omit_thinking = omit_thinking
        self._open: dict[str, Any] | None = None
        self._pieces: list[str] = []

    def _events(self, out: list[bytes], type: str, fields: dict[str, Any]) -> None:
        if self._stream:
            out.append(sse_event(type, fields))

    def _start(self, out: list[bytes], block: dict[str, Any]) -> None:
        self._close(out)
        self._open, self._pieces = block, []
        self._events(out, "content_block_start", {"index": len(self.content), "content_block": block})

    def _delta(self, out: list[bytes], kind: str, key: str, text: str) -> None:
        self._pieces.append(text)
        if kind == "thinking_delta" and self._omit_thinking:
            return
        self._events(out, "content_block_delta",
                     {"index": len(self.content), "delta": {"type": kind, key: text}})

    def _close(self, out: list[bytes]) -> None:
        block = self._open
        if block is None:
            return
        text = "".join(self._pieces)
        index = len(self.content)
        if block["type"] == "thinking":
            sig = signature(text)
            self._events(out, "content_block_delta",
                         {"index": index, "delta": {"type": "signature_delta", "signature": sig}})
            block = {"type": "thinking", "thinking": "" if self._omit_thinking else text, "signature": sig}
        elif block["type"] == "text":
            block = {"type": "text", "text": text}
        else:
            block = {**block, "input": tool_input(text)}
        self._events(out, "content_block_stop", {"index": index})
        self.content.append(block)
        self._open = None

    def _call(self, out: list[bytes], delta: ToolCallDelta) -> None:
        if delta.id is not None:
            block: dict[str, Any] = {"type": "tool_use", "id": tool_use_id(delta.id), "name": delta.name,
                                     "input": {}}
            self._start(out, block)
        if delta.arguments and self._open is not None and self._open["type"] == "tool_use":
            self._delta(out, "input_json_delta", "partial_json", delta.arguments)

    def feed(self, parts: ChoiceParts) -> list[bytes]:
        """One piece of the choice's output -> its events (empty when not streaming)."""
        out: list[bytes] = []
        if parts.reasoning:
            if self._open is None or self._open["type"] != "thinking":
                self._start(out, {"type": "thinking", "thinking": "", "signature": ""})
            self._delta(out, "thinking_delta", "thinking", parts.reasoning)
        if parts.content:
            if self._open is None or self._open["type"] != "text":
                self._start(out, {"type": "text", "text": ""})
            self._delta(out, "text_delta", "text", parts.content)
        for call in parts.calls:
            self._call(out, call)
        return out

    def close(self) -> list[bytes]:
        """The end of the output: the open block is closed; its events."""
        out: list[bytes] = []
        self._close(out)
        return out

    @property
    def has_tool_use(self) -> bool:
        """A ``tool_use`` block was produced."""
        return any(b["type"] == "tool_use" for b in self.content)
