"""Every Responses body and stream event validates against the OpenAI Python SDK's own types
(``openai.types.responses``, pydantic, required fields enforced): text, ``incomplete``, logprobs, a
function call (in-process app, FakeEngine), and a reasoning item (``ResponseOutput`` fed directly).
Clients that validate (the Vercel AI SDK's zod schemas, strict pydantic users) need each required
field; the SDK's own parsing is lenient and would not notice a missing one."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from proxy.api.responses_api.output import ResponseOutput
from proxy.hotpath import EventFramer
from proxy.pipeline import ChoiceParts
from proxy.tools.parsers.calls import ToolCallDelta

from .conftest import MODEL, REPLY, reply_ids, run, serve
from .fakes import FakeEngine, make_tokenizer

EVENT = TypeAdapter(ResponseStreamEvent)
TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def events(raw: bytes) -> list[dict[str, Any]]:
    """The events of a Responses stream: ``event: <type>\\ndata: <json>`` each, the names matching."""
    out = []
    for block in raw.decode("utf-8").removesuffix("\n\n").split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        out.append(event)
    return out


CASES = [
    ("text", REPLY, {}, "completed", ["message"]),
    ("incomplete", REPLY, {"max_output_tokens": 3}, "incomplete", ["message"]),
    (
        "logprobs",
        REPLY,
        {"include": ["message.output_text.logprobs"], "top_logprobs": 2},
        "completed",
        ["message"],
    ),
    ("function call", HERMES, {"tools": [TOOL]}, "completed", ["function_call"]),
]


@pytest.mark.parametrize(
    ("text", "fields", "status", "kinds"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bodies_and_events_validate(text: str, fields: dict[str, Any], status: str, kinds: list[str]) -> None:
    async def main() -> tuple[Any, Any, Any]:
        engine = FakeEngine(reply_ids=reply_ids(make_tokenizer(), text))
        async with serve(engine, tool_call_parser="hermes", max_model_len=2048) as s:
            body = {"model": MODEL, "input": "hi", **fields}
            full = await s.client.post("/v1/responses", json=body)
            streamed = await s.client.post("/v1/responses", json={**body, "stream": True})
            got = await s.client.get(f"/v1/responses/{full.json()['id']}")
            return full, streamed, got

    full, streamed, got = run(main())
    assert full.status_code == 200, full.text
    body = Response.model_validate(full.json())
    assert got.json() == full.json()
    assert body.status == status and [i.type for i in body.output] == kinds
    evs = events(streamed.content)
    for e in evs:
        EVENT.validate_python(e)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    final = Response.model_validate(evs[-1]["response"])
    assert evs[-1]["type"] == f"response.{status}" and final.status == status
    assert [i.type for i in final.output] == kinds
    assert [i.model_dump(exclude={"id", "call_id"}) for i in final.output] == [
        i.model_dump(exclude={"id", "call_id"}) for i in body.output
    ]
    if kinds == ["function_call"]:
        assert final.output[0].arguments == '{"city": "Oslo"}'  # type: ignore[union-attr]
        args = [e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta"]
        assert "".join(args) == '{"city": "Oslo"}'


def test_reasoning_item_events_validate() -> None:
    framer = EventFramer()
    output = ResponseOutput(framer)
    raw = output.feed(ChoiceParts(reasoning="Think "))
    raw += output.feed(ChoiceParts(reasoning="hard."))
    raw += output.feed(ChoiceParts(content="Yes."))
    raw += output.feed(
        ChoiceParts(calls=[ToolCallDelta(0, "call_1", "f", ""), ToolCallDelta(0, None, None, "{}")])
    )
    raw += output.close()
    evs = events(b"".join(raw))
    for e in evs:
        EVENT.validate_python(e)
    types = [e["type"] for e in evs]
    assert types[:4] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_text.delta",
    ]
    assert [i["type"] for i in output.items] == ["reasoning", "message", "function_call"]
    reasoning = output.items[0]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Think hard."}]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "Think hard."}]
    assert output.output_text == "Yes." and output.reasoning_text == "Think hard."
    assert [e["output_index"] for e in evs if e["type"] == "response.output_item.done"] == [0, 1, 2]
    Response.model_validate(
        {
            "id": "resp_1",
            "object": "response",
            "created_at": 0,
            "model": MODEL,
            "output": output.items,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
    )
