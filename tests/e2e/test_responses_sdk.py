"""The Responses API (``/v1/responses``) end to end with the OpenAI Python SDK, the default model.

One server for the module (the engine-thread one of the e2e suite, shared through ``get_server``).
Exact values where the model is deterministic (temperature 0, one seed): a stream equals the
non-stream response of the same request, the deltas join to the final ``output_text``, the input
token count equals ``usage.input_tokens``."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from .server import Server, get_server

pytestmark = pytest.mark.slow

STORY = "Write a story about a dragon who learns to bake bread."
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    return get_server(tmp_path_factory.mktemp("responses"))


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_create_text(client: openai.OpenAI, server: Server) -> None:
    r = client.responses.create(
        model=server.model,
        input=STORY,
        max_output_tokens=12,
        temperature=0,
        instructions="You are a storyteller.",
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == server.model
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == "You are a storyteller." and r.max_output_tokens == 12
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert r.output_text and r.output_text == message.content[0].text
    assert r.usage is not None and r.usage.output_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_stream_events_in_order_and_equal_to_the_body(client: openai.OpenAI, server: Server) -> None:
    args = {
        "model": server.model,
        "input": STORY,
        "max_output_tokens": 8,
        "temperature": 0,
        "extra_body": {"seed": 3},
    }
    full = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    final = events[-1].response
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == final.output_text == full.output_text
    assert events[-4].text == final.output_text
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"
    assert final.status == full.status == "incomplete"
    assert final.incomplete_details is not None and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage is not None and full.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (full.usage.input_tokens, 8)
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_stream_helper_final_response(client: openai.OpenAI, server: Server) -> None:
    # get_final_response() needs response.completed (an incomplete stream raises in the SDK, as with
    # OpenAI): guided_choice makes the answer short and complete
    with client.responses.stream(
        model=server.model,
        input="Say hello.",
        max_output_tokens=30,
        temperature=0,
        extra_body={"guided_choice": ["Hello there, friend!"]},
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.incomplete_details is None
    assert "".join(deltas) == final.output_text and final.output_text == "Hello there, friend!"
    assert final.usage is not None and final.usage.output_tokens < 30


def test_parse_text_format(client: openai.OpenAI, server: Server) -> None:
    r = client.responses.parse(
        model=server.model,
        input="Describe the capital of France as JSON.",
        text_format=City,
        max_output_tokens=60,
        temperature=0,
    )
    assert r.status == "completed"
    city = r.output_parsed
    assert isinstance(city, City) and city == City.model_validate_json(r.output_text)
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"


def test_required_tool_then_function_call_output(client: openai.OpenAI, server: Server) -> None:
    first = client.responses.create(
        model=server.model,
        input="What is the weather in Paris?",
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
        parallel_tool_calls=False,
    )
    assert first.status == "completed"
    (call,) = [i for i in first.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city"}
    second = client.responses.create(
        model=server.model,
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
        tools=[WEATHER_TOOL],
        tool_choice="none",
        input=[
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": json.dumps({"temperature_c": 21, "sky": "clear"}),
            }
        ],
    )
    assert second.previous_response_id == first.id
    assert second.output[0].type == "message" and second.output_text
    assert second.status == "incomplete" and second.usage is not None and second.usage.output_tokens == 8
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]


def test_previous_response_id_reuses_the_prefix_cache(client: openai.OpenAI, server: Server) -> None:
    first = client.responses.create(
        model=server.model,
        input="My name is Ada. Remember it.",
        instructions="You are a concise assistant.",
        max_output_tokens=8,
        temperature=0,
    )
    second = client.responses.create(
        model=server.model,
        previous_response_id=first.id,
        input="What is my name?",
        max_output_tokens=4,
        temperature=0,
    )
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]


def test_retrieve_delete_then_404(client: openai.OpenAI, server: Server) -> None:
    raw = httpx.post(
        f"{server.base_url}/v1/responses",
        timeout=300,
        json={"model": server.model, "input": "Hi", "max_output_tokens": 4, "temperature": 0},
    )
    got = httpx.get(f"{server.base_url}/v1/responses/{raw.json()['id']}", timeout=30)
    assert got.status_code == 200 and got.json() == raw.json()
    r = client.responses.retrieve(raw.json()["id"])
    assert r.model_dump(exclude_unset=True) == raw.json()
    deleted = httpx.delete(f"{server.base_url}/v1/responses/{r.id}", timeout=30)
    assert deleted.json() == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.retrieve(r.id)
    assert exc.value.code == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model=server.model, input="Hi", previous_response_id=r.id)
    assert exc.value.param == "previous_response_id"
    unstored = client.responses.create(model=server.model, input="Hi", max_output_tokens=1, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_input_tokens_equal_usage(client: openai.OpenAI, server: Server) -> None:
    args = {
        "model": server.model,
        "instructions": "Answer briefly.",
        "tools": [WEATHER_TOOL],
        "input": [{"role": "user", "content": "What is the weather in Rome?"}],
    }
    counted = client.responses.input_tokens.count(**args)  # type: ignore[arg-type]
    r = client.responses.create(**args, max_output_tokens=1, temperature=0)  # type: ignore[arg-type]
    assert counted.object == "response.input_tokens"
    assert r.usage is not None and counted.input_tokens == r.usage.input_tokens > 20


MULTIBYTE = "月亮🌙很美，龍🐉と🍞"


def test_multibyte_stream_never_split(client: openai.OpenAI, server: Server) -> None:
    # guided_choice forces the exact text: its characters span several byte-level BPE tokens each
    events = list(
        client.responses.create(
            model=server.model,
            input="Say something nice.",
            temperature=0,
            max_output_tokens=30,
            stream=True,
            extra_body={"guided_choice": [MULTIBYTE]},
        )
    )
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type == "response.completed"
    assert "".join(deltas) == events[-1].response.output_text == MULTIBYTE
    assert len(deltas) >= 5 and all(d and "\ufffd" not in d for d in deltas)
