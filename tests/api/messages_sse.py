"""Helpers of the Messages API tests: Anthropic's SSE framing read strictly, events validated with the
``anthropic`` SDK's own types, stream events folded back into the message they describe."""

from __future__ import annotations

import json
from typing import Any

from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

MODEL = "test-model"
TOOL = {"name": "get_weather", "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
HERMES = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
THINK_CALL = "<think>Hmm, 你好 🤗 weather.</think>" + HERMES
_EVENT = TypeAdapter(RawMessageStreamEvent)


def body(content: Any = "Hi", **kw: Any) -> dict[str, Any]:
    """A Messages body with one user message and ``max_tokens`` 1000 (overridden by ``kw``)."""
    return {"model": MODEL, "max_tokens": 1000, "messages": [{"role": "user", "content": content}], **kw}


def events(raw: bytes) -> list[dict[str, Any]]:
    """The events of an Anthropic stream, split on ``\\n`` only: each ``event: <type>`` line then one
    ``data: <JSON>`` line whose ``type`` is the same, then a blank line; ``ping`` events included;
    every non-ping event validated with the SDK's ``RawMessageStreamEvent`` union."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    out = []
    for block in raw[:-2].decode("utf-8").split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        obj = json.loads(lines[1][len("data: "):])
        assert obj["type"] == lines[0][len("event: "):]
        if obj["type"] not in ("ping", "error"):
            _EVENT.validate_python(obj)
        out.append(obj)
    return out


def fold(evts: list[dict[str, Any]]) -> dict[str, Any]:
    """The message a complete stream describes: ``message_start``'s message, each block from its
    start and deltas (``partial_json`` joined then parsed), ``message_delta``'s stop reason and usage.
    Asserts Anthropic's order: start, blocks (start, deltas, stop, indexes in order), delta, stop."""
    kinds = [e["type"] for e in evts if e["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    msg = dict(evts[0]["message"])
    blocks: list[dict[str, Any]] = []
    pieces: list[list[str]] = []
    open_index = None
    for e in evts:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == len(blocks)
            blocks.append(dict(e["content_block"]))
            pieces.append([])
            open_index = e["index"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
            d = e["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json",
                   "signature_delta": "signature"}[d["type"]]
            if key == "signature":
                blocks[-1]["signature"] = d["signature"]
            else:
                assert d[key], "empty delta"
                pieces[-1].append(d[key])
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_index
            block, text = blocks[-1], "".join(pieces[-1])
            if block["type"] == "tool_use":
                block["input"] = json.loads(text) if text else {}
            else:
                block[block["type"]] = text
            open_index = None
        elif e["type"] == "message_delta":
            assert open_index is None
            msg.update(e["delta"])
            msg["usage"] = {**msg["usage"], **e["usage"]}
    msg["content"] = blocks
    Message.model_validate(msg)
    return msg


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal messages apart from the ids (``msg_``, ``toolu_``), which are fresh per request."""
    def strip(m: dict[str, Any]) -> dict[str, Any]:
        content = [{k: v for k, v in c.items() if k != "id"} for c in m["content"]]
        return {**{k: v for k, v in m.items() if k != "id"}, "content": content}
    return strip(a) == strip(b)
