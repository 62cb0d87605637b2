"""The output items of one response, built from the parts of its choice, and their stream events.

:class:`ResponseOutput` is fed the :class:`~proxy.pipeline.ChoiceParts` of the one choice a response
has (the same split as chat's) and keeps OpenAI's output items in order: a ``reasoning`` item
(``content: [{"type": "reasoning_text"}]``), a ``message`` item with one ``output_text`` part, and a
``function_call`` item per call. With an :class:`~proxy.hotpath.EventFramer` it also returns the
stream events of each piece, in the order of OpenAI "Streaming responses":
``response.output_item.added`` -> ``response.content_part.added`` -> ``*.delta`` ... ->
``*.done`` -> ``response.content_part.done`` -> ``response.output_item.done`` per item (a function
call has ``response.function_call_arguments.delta`` / ``.done`` and no content part). An item is
closed when the next one opens, or at :meth:`ResponseOutput.close`. The reasoning item also sends the
summary events clients read (``response.reasoning_summary_part.added``,
``response.reasoning_summary_text.delta`` / ``.done``, ``response.reasoning_summary_part.done``),
the summary being the reasoning text itself.
"""

from __future__ import annotations

import uuid
from typing import Any

from proxy.hotpath import EventFramer, dumps
from proxy.pipeline import ChoiceParts
from proxy.protocol import LogprobEntry

TEXT_DELTA = "response.output_text.delta"
REASONING_DELTA = "response.reasoning_text.delta"
SUMMARY_DELTA = "response.reasoning_summary_text.delta"
ARGUMENTS_DELTA = "response.function_call_arguments.delta"


def item_id(prefix: str) -> str:
    """A fresh output item id (``msg_...``, ``rs_...``, ``fc_...``), as OpenAI's."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput:
    """The output items of one response, and (with ``framer``) their stream events.

    Args:
        framer: the stream's event framer; None for a non-stream response (no events are built).
        with_logprobs: ``output_text`` parts carry ``logprobs`` (``include`` asked for them).
    """

    def __init__(self, framer: EventFramer | None, with_logprobs: bool = False) -> None:
        self.items: list[dict[str, Any]] = []
        self._framer = framer
        self._with_logprobs = with_logprobs
        self._open: dict[str, Any] | None = None
        self._text: list[str] = []
        self._logprobs: list[dict[str, Any]] = []
        self.reasoning_text = ""
        self._cut = False  # the open item is closed by a max_tokens cut

    # ---- events --------------------------------------------------------------------------------

    def _event(self, out: list[bytes], type: str, fields: dict[str, Any]) -> None:
        if self._framer is not None:
            out.append(self._framer.event(type, dumps(fields)))

    def _delta(self, out: list[bytes], type: str, content_index: int | None, text: str,
               logprobs: str | None = None) -> None:
        if self._framer is not None and self._open is not None:
            item = self._open["id"]
            out.append(self._framer.delta(type, item, len(self.items), content_index, text, logprobs))

    # ---- items ---------------------------------------------------------------------------------

    def _start(self, out: list[bytes], item: dict[str, Any]) -> None:
        self._close(out)
        self._open, self._text, self._logprobs = item, [], []
        self._event(out, "response.output_item.added", {"output_index": len(self.items), "item": item})
        ids = {"item_id": item["id"], "output_index": len(self.items)}
        if item["type"] == "message":
            self._event(out, "response.content_part.added",
                        {**ids, "content_index": 0, "part": self._part("")})
        elif item["type"] == "reasoning":
            self._event(out, "response.content_part.added",
                        {**ids, "content_index": 0, "part": {"type": "reasoning_text", "text": ""}})
            self._event(out, "response.reasoning_summary_part.added",
                        {**ids, "summary_index": 0, "part": {"type": "summary_text", "text": ""}})

    def _part(self, text: str) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        part["logprobs"] = self._logprobs if self._with_logprobs else []
        return part

    def _close(self, out: list[bytes]) -> None:
        item = self._open
        if item is None:
            return
        text = "".join(self._text)
        ids = {"item_id": item["id"], "output_index": len(self.items)}
        if item["type"] == "message":
            part = self._part(text)
            self._event(out, "response.output_text.done", {**ids, "content_index": 0, "text": text,
                                                           "logprobs": part["logprobs"]})
            self._event(out, "response.content_part.done", {**ids, "content_index": 0, "part": part})
            item = {**item, "status": "incomplete" if self._cut else "completed", "content": [part]}
        elif item["type"] == "reasoning":
            summary = {"type": "summary_text", "text": text}
            self._event(out, "response.reasoning_summary_text.done",
                        {**ids, "summary_index": 0, "text": text})
            self._event(out, "response.reasoning_summary_part.done",
                        {**ids, "summary_index": 0, "part": summary})
            self._event(out, "response.reasoning_text.done", {**ids, "content_index": 0, "text": text})
            part = {"type": "reasoning_text", "text": text}
            self._event(out, "response.content_part.done", {**ids, "content_index": 0, "part": part})
            item = {**item, "summary": [summary], "content": [part]}
            self.reasoning_text += text
        else:
            self._event(out, "response.function_call_arguments.done", {**ids, "arguments": text,
                                                                      "name": item["name"]})
            item = {**item, "status": "incomplete" if self._cut else "completed", "arguments": text}
        self._event(out, "response.output_item.done", {"output_index": len(self.items), "item": item})
        self.items.append(item)
        self._open = None

    def _kind(self) -> str | None:
        return None if self._open is None else str(self._open["type"])

    def feed(self, parts: ChoiceParts, logprobs: list[LogprobEntry] | None = None) -> list[bytes]:
        """Add one piece of the choice's output; returns its stream events (none without a framer)."""
        out: list[bytes] = []
        if parts.reasoning:
            if self._kind() != "reasoning":
                self._start(out, {"id": item_id("rs"), "type": "reasoning", "summary": []})
            self._text.append(parts.reasoning)
            self._delta(out, REASONING_DELTA, 0, parts.reasoning)
            if self._open is not None:
                self._event(out, SUMMARY_DELTA, {"item_id": self._open["id"], "output_index": len(self.items),
                                                 "summary_index": 0, "delta": parts.reasoning})
        if parts.content or logprobs:
            if self._kind() != "message":
                self._start(out, {"id": item_id("msg"), "type": "message", "status": "in_progress",
                                  "role": "assistant", "content": []})
            self._text.append(parts.content)
            entries = [e.to_chat() for e in logprobs or ()] if self._with_logprobs else []
            self._logprobs.extend(entries)
            self._delta(out, TEXT_DELTA, 0, parts.content, dumps(entries))
        for call in parts.calls:
            if call.id is not None:
                self._start(out, {"id": item_id("fc"), "type": "function_call", "status": "in_progress",
                                  "call_id": call.id, "name": call.name, "arguments": ""})
            if call.arguments and self._kind() == "function_call":
                self._text.append(call.arguments)
                self._delta(out, ARGUMENTS_DELTA, None, call.arguments)
        return out

    def close(self, finish_reason: str | None = None) -> list[bytes]:
        """End of the choice: the open item is closed (``status: "incomplete"`` when ``max_tokens``
        cut it, finish reason ``length``, as OpenAI marks a cut item); an output without any item gets
        an empty message (as OpenAI answers an empty completion)."""
        out: list[bytes] = []
        if not self.items and self._open is None:
            self._start(out, {"id": item_id("msg"), "type": "message", "status": "in_progress",
                              "role": "assistant", "content": []})
        self._cut = finish_reason == "length"
        self._close(out)
        return out

    @property
    def output_text(self) -> str:
        """The SDKs' ``response.output_text``: the text of every message item, joined."""
        return "".join(p["text"] for i in self.items if i["type"] == "message" for p in i["content"])
