"""Structured outputs and tool calls end to end: OpenAI SDK, LangChain, raw HTTP, the default model."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from .server import Server, sse_chunks

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=50)


class GetWeather(BaseModel):
    """Get the current weather of a city."""

    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


ASK_CITY = [{"role": "user", "content": "Describe the capital of France as JSON."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "maxLength": 10}},
            "required": ["tz"],
        },
    },
}


def post(server: Server, body: dict) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/chat/completions", json={"model": server.model, **body}, timeout=300
    )


def test_openai_sdk_parse_and_stream(server: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    done = client.chat.completions.parse(model=server.model, messages=ASK_CITY, response_format=City,
                                         temperature=0, max_tokens=80)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, City) and done.choices[0].finish_reason == "stop"
    with client.chat.completions.stream(model=server.model, messages=ASK_CITY, response_format=City,
                                        temperature=0, max_tokens=80) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == parsed


def test_langchain_structured_output_methods(server: Server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", model=server.model, temperature=0,
                     max_tokens=80)
    for method in (None, "json_schema", "function_calling"):
        runnable = (
            llm.with_structured_output(City)
            if method is None
            else llm.with_structured_output(City, method=method)
        )
        assert isinstance(runnable.invoke("Describe the capital of France."), City), method
    result = llm.with_structured_output(None, method="json_mode").invoke(
        "Describe the capital of France as a JSON object.")
    assert isinstance(result, dict)


def test_langchain_bind_tools_invoke_stream_and_round_trip(server: Server) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", model=server.model, temperature=0,
                     max_tokens=60)
    bound = llm.bind_tools([GetWeather], tool_choice="any")
    ai = bound.invoke("What is the weather in Paris?")
    assert len(ai.tool_calls) >= 1 and ai.tool_calls[0]["name"] == "GetWeather"
    GetWeather(**ai.tool_calls[0]["args"])
    total = None
    for piece in bound.stream("What is the weather in Paris?"):
        total = piece if total is None else total + piece
    assert total is not None and [c["name"] for c in total.tool_calls] == [c["name"] for c in ai.tool_calls]
    assert total.tool_calls[0]["args"] == ai.tool_calls[0]["args"]
    history = [HumanMessage("What is the weather in Paris?"), ai,
               ToolMessage("18 degrees and sunny", tool_call_id=ai.tool_calls[0]["id"])]
    answer = llm.invoke(history)
    assert isinstance(answer.content, str) and answer.content


SCHEMAS = [
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["ok", "n"],
    },
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "email": {"type": "string", "format": "email", "maxLength": 30},
                },
                "required": ["name"],
            },
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        },
        "required": ["person", "tags"],
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "null"}]},
    {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "when": {"type": "string", "format": "date"},
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        },
        "required": ["score", "when", "code"],
    },
]


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_schema_corpus_validates_and_stream_equals_non_stream(server: Server, index: int) -> None:
    schema = SCHEMAS[index]
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    for seed, temperature in ((index, 0.0), (index + 1, 1.2)):
        body = {"messages": [{"role": "user", "content": "Answer with JSON."}], "response_format": rf,
                "max_tokens": 60, "seed": seed, "temperature": temperature}
        full = post(server, body).json()
        choice = full["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        else:
            assert choice["finish_reason"] == "length"
        raw = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=300,
                         json={"model": server.model, **body, "stream": True}).content
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_chunks(raw) if c["choices"])
        assert text == choice["message"]["content"]


def test_tool_call_shapes_stream_and_non_stream(server: Server) -> None:
    body = {"messages": ASK_WEATHER, "tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": "required",
            "max_tokens": 80, "temperature": 0.7, "seed": 5}
    full = post(server, body).json()
    choice = full["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert calls and all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    tools = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}
    for c in calls:
        jsonschema.validate(
            json.loads(c["function"]["arguments"]), tools[c["function"]["name"]]["function"]["parameters"]
        )
    raw = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=300,
                     json={"model": server.model, **body, "stream": True}).content
    chunks = [c for c in sse_chunks(raw) if c["choices"]]
    streamed: dict[int, dict] = {}
    for c in chunks:
        for d in c["choices"][0]["delta"].get("tool_calls") or []:
            if "id" in d:
                streamed[d["index"]] = {
                    "name": d["function"]["name"],
                    "arguments": d["function"]["arguments"],
                }
            else:
                streamed[d["index"]]["arguments"] += d["function"]["arguments"]
    assert [streamed[i] for i in sorted(streamed)] == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    named = post(server, {**body, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                          "parallel_tool_calls": False}).json()["choices"][0]
    assert [c["function"]["name"] for c in named["message"]["tool_calls"]] == ["get_time"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strng"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [*ASK_WEATHER, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ],
)
def test_bad_requests_name_the_field(server: Server, body: dict, param: str) -> None:
    r = post(server, {"messages": ASK_WEATHER, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
