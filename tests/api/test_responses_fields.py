"""The response object's fields that strict validators require (the Open Responses compliance suite's
``ResponseResource``, whose zod schema makes each key required, null allowed where OpenAI allows it):
``completed_at`` (Unix seconds when completed, else null), ``presence_penalty`` and
``frequency_penalty`` (as used, 0 by default), ``safety_identifier`` and ``prompt_cache_key`` (echoed),
and every function tool shown with ``name``, ``description``, ``parameters`` and ``strict``. Bodies,
stored copies and stream events are checked, and each still validates against openai-python's types."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import FunctionTool, Response

from .conftest import MODEL, REPLY, reply_ids, run, serve
from .fakes import FakeEngine, make_tokenizer

# The keys Open Responses' ResponseResource requires (its schema/ and the suite's zod schema).
OPEN_RESPONSES_KEYS = {
    "id", "object", "created_at", "completed_at", "status", "incomplete_details", "model",
    "previous_response_id", "instructions", "output", "error", "tools", "tool_choice", "truncation",
    "parallel_tool_calls", "text", "top_p", "presence_penalty", "frequency_penalty", "top_logprobs",
    "temperature", "reasoning", "usage", "max_output_tokens", "max_tool_calls", "store", "background",
    "service_tier", "metadata", "safety_identifier", "prompt_cache_key",
}
TOOL = {"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}}


def stream_events(raw: bytes) -> list[dict[str, Any]]:
    """The JSON events of a Responses stream (``event:`` + ``data:`` blocks)."""
    blocks = raw.decode("utf-8").removesuffix("\n\n").split("\n\n")
    return [json.loads(b.split("\n")[1].removeprefix("data: ")) for b in blocks if not b.startswith(":")]


async def _post(fields: dict[str, Any], *, stream: bool = False) -> tuple[int, Any]:
    engine = FakeEngine(reply_ids=reply_ids(make_tokenizer(), REPLY))
    async with serve(engine, max_model_len=2048) as s:  # room for a tool prompt
        r = await s.client.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": stream,
                                                       **fields})
        if stream:
            return r.status_code, stream_events(r.content)
        body = r.json()
        if r.status_code == 200:
            got = await s.client.get(f"/v1/responses/{body['id']}")
            assert got.json() == body  # the stored copy shows the same fields
        return r.status_code, body


def test_defaults_are_present_and_validate() -> None:
    status, body = run(_post({}))
    assert status == 200, body
    assert OPEN_RESPONSES_KEYS <= body.keys(), OPEN_RESPONSES_KEYS - body.keys()
    assert body["status"] == "completed"
    assert isinstance(body["completed_at"], int) and body["completed_at"] >= body["created_at"]
    assert (body["presence_penalty"], body["frequency_penalty"]) == (0.0, 0.0)
    assert body["safety_identifier"] is None and body["prompt_cache_key"] is None
    parsed = Response.model_validate(body)
    assert parsed.completed_at == body["completed_at"]


def test_sent_values_are_echoed() -> None:
    fields = {"presence_penalty": 0.5, "frequency_penalty": -0.25, "safety_identifier": "user-hash-1",
              "prompt_cache_key": "session-7", "temperature": None, "top_p": None}
    status, body = run(_post(fields))
    assert status == 200, body
    assert (body["presence_penalty"], body["frequency_penalty"]) == (0.5, -0.25)
    assert (body["safety_identifier"], body["prompt_cache_key"]) == ("user-hash-1", "session-7")
    assert (body["temperature"], body["top_p"]) == (1.0, 1.0)  # null means the default, shown as used
    parsed = Response.model_validate(body)
    assert (parsed.safety_identifier, parsed.prompt_cache_key) == ("user-hash-1", "session-7")


def test_incomplete_has_no_completed_at() -> None:
    status, body = run(_post({"max_output_tokens": 3}))
    assert status == 200 and body["status"] == "incomplete"
    assert body["completed_at"] is None
    Response.model_validate(body)


@pytest.mark.parametrize(
    ("tool", "shown"),
    [
        (TOOL, {**TOOL, "description": None, "strict": None}),
        ({**TOOL, "description": "Weather.", "strict": True}, {**TOOL, "description": "Weather.",
                                                               "strict": True}),
        ({"type": "function", "name": "now"}, {"type": "function", "name": "now", "description": None,
                                               "parameters": None, "strict": None}),
    ],
    ids=["no strict", "strict true", "name only"],
)
def test_tools_show_every_field(tool: dict[str, Any], shown: dict[str, Any]) -> None:
    status, body = run(_post({"tools": [tool]}))
    assert status == 200, body
    assert body["tools"] == [shown]
    assert list(body["tools"][0]) == ["type", "name", "description", "parameters", "strict"]
    FunctionTool.model_validate(body["tools"][0])
    Response.model_validate(body)


def test_stream_completed_at_only_on_the_final_object() -> None:
    status, events = run(_post({"prompt_cache_key": "k"}, stream=True))
    assert status == 200
    created, final = events[0]["response"], events[-1]["response"]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert created["completed_at"] is None and created["status"] == "in_progress"
    assert isinstance(final["completed_at"], int)
    for obj in (created, final):
        assert OPEN_RESPONSES_KEYS <= obj.keys()
        assert obj["prompt_cache_key"] == "k"
        Response.model_validate(obj)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"safety_identifier": "x" * 129}, "safety_identifier"),
        ({"safety_identifier": 7}, "safety_identifier"),
        ({"prompt_cache_key": {"k": 1}}, "prompt_cache_key"),
        ({"tools": [{**TOOL, "strict": "yes"}]}, "tools[0].strict"),
    ],
    ids=["safety_identifier too long", "safety_identifier number", "prompt_cache_key object",
         "strict not a boolean"],
)
def test_malformed_echoed_strings_are_400s(fields: dict[str, Any], param: str) -> None:
    status, body = run(_post(fields))
    assert status == 400, body
    assert body["error"]["param"] == param
