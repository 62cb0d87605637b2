"""Validation of response_format / guided_* / tools / tool_choice and the agent-loop messages."""

from __future__ import annotations

import json

import pytest

from proxy.errors import InvalidRequestError
from proxy.sampling import StructuredOutputParams
from proxy.tools.request import (
    parse_chat_tools,
    parse_structured_outputs,
    template_messages,
    tool_system_prompt,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_response_format_kinds() -> None:
    assert parse_structured_outputs({}) == (None, None)
    assert parse_structured_outputs({"response_format": {"type": "text"}}) == (None, None)
    assert parse_structured_outputs({"response_format": {"type": "json_object"}}) == (
        StructuredOutputParams("json_object"), "response_format")
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    so, field = parse_structured_outputs(
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": True},
            }
        }
    )
    assert field == "response_format" and so.kind == "json" and json.loads(so.spec) == schema
    assert list(json.loads(so.spec)["properties"]) == ["b", "a"]  # property order kept
    assert parse_structured_outputs({"guided_choice": ["a", "b"]})[0] == StructuredOutputParams(
        "choice", '["a", "b"]'
    )
    assert parse_structured_outputs({"guided_regex": "[0-9]+"})[0] == StructuredOutputParams(
        "regex", "[0-9]+"
    )
    assert parse_structured_outputs({"guided_json": '{"type": "integer"}'})[0].kind == "json"
    assert parse_structured_outputs({"structured_outputs": {"regex": "a+"}}) == (
        StructuredOutputParams("regex", "a+"), "structured_outputs")


@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
            "must be a JSON Schema object",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format.json_schema.schema",
            "'uniqueItems'",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strng"}}}},
            "response_format.json_schema.schema",
            "invalid JSON Schema type",
        ),
        ({"guided_choice": []}, "guided_choice", "non-empty array"),
        ({"guided_json": "{nope"}, "guided_json", "must be a JSON Schema"),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "guided_regex",
            "cannot be used together",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ],
)
def test_response_format_errors(body, param: str, text: str) -> None:
    with pytest.raises(InvalidRequestError, match=text) as info:
        parse_structured_outputs(body)
    assert info.value.param == param and info.value.status == 400


def test_tools_and_choices() -> None:
    assert parse_chat_tools({}) is None
    assert parse_chat_tools({"tools": [], "tool_choice": "none"}) is None
    auto = parse_chat_tools({"tools": [WEATHER, TIME]})
    assert auto.choice.mode == "auto" and auto.is_parsed and not auto.is_constrained and auto.parallel
    assert auto.grammar() is None
    assert auto.template_tools()[1] == {"type": "function", "function": {"name": "get_time",
                                        "parameters": {"type": "object", "properties": {}}}}
    named = parse_chat_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                              "function": {"name": "get_weather"}}})
    assert named.choice.name == "get_weather" and [t["function"]["name"] for t in named.template_tools()] == [
        "get_weather"
    ]
    assert json.loads(named.grammar().spec) == WEATHER["function"]["parameters"]
    calls = named.calls_from_output('{"city": "Paris"}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert named.calls_from_output('{"city": "Pa') is None
    required = parse_chat_tools(
        {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    )
    schema = json.loads(required.grammar().spec)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    calls = required.calls_from_output('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                                       '"parameters": {"city": "Oslo"}}]')
    assert [c.name for c in calls] == ["get_time", "get_weather"] and calls[1].arguments == '{"city": "Oslo"}'
    assert all(c.id.startswith("call_") for c in calls)
    assert "get_weather" in tool_system_prompt(required) and "JSON array" in tool_system_prompt(required)
    assert "arguments as a JSON object" in tool_system_prompt(named)


@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        ({"tool_choice": "auto"}, "tool_choice", "only allowed when 'tools'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "'nope', which is not in 'tools'"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
        ({"tools": [WEATHER], "tool_choice": 3}, "tool_choice", "must be a string or an object"),
        ({"tools": {"a": 1}}, "tools", "must be an array"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "must be 'function'"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "required"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "Duplicate"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "tools[0].function.parameters", "JSON Schema object"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
    ],
)
def test_tool_errors(body, param: str, text: str) -> None:
    with pytest.raises(InvalidRequestError, match=text) as info:
        parse_chat_tools(body)
    assert info.value.param == param


def test_unenforceable_tool_parameters_refused_only_when_constrained() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}
    assert parse_chat_tools({"tools": [tool]}).grammar() is None  # auto: shown to the template only
    with pytest.raises(InvalidRequestError, match="'not'") as info:
        parse_chat_tools({"tools": [tool], "tool_choice": "required"}).grammar()
    assert info.value.param == "tools[0].function.parameters"


def test_agent_loop_messages() -> None:
    raw = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    validated = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None},
                 {"role": "tool", "content": "sunny"}]
    with_tools = template_messages(validated, raw, template_has_tools=True)
    assert with_tools[1]["content"] == "" and with_tools[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"
    }
    assert with_tools[2] == {
        "role": "tool",
        "content": "sunny",
        "tool_call_id": "call_1",
        "name": "get_weather",
    }
    plain = template_messages(validated, raw, template_has_tools=False)
    assert "tool_calls" not in plain[1]
    assert json.loads(plain[1]["content"]) == [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    with pytest.raises(InvalidRequestError) as info:
        template_messages(
            validated, [raw[0], raw[1], {"role": "tool", "content": "x"}], template_has_tools=True
        )
    assert info.value.param == "messages[2].tool_call_id"
    cut = [  # arguments that are not JSON (a call max_tokens cut) reach the template as the text
        raw[0],
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
        raw[2],
    ]
    assert template_messages(validated, cut, template_has_tools=True)[1]["tool_calls"][0]["function"] == {
        "name": "f", "arguments": "{x"}
