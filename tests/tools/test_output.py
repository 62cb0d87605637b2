"""ChoiceToolOutput: auto (parsed), required/named (grammar-shaped JSON), cut outputs, chunk shape."""

from __future__ import annotations

import json

from proxy.hotpath import ChunkFramer, dumps
from proxy.tools.output import ChoiceToolOutput
from proxy.tools.request import parse_chat_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def run(out: ChoiceToolOutput, pieces: list[str], reason: str):
    content, deltas = [], []
    for p in pieces:
        c, d = out.feed(p)
        content.append(c)
        deltas += d
    c, d, final = out.finish(reason)
    return "".join(content) + c, deltas + d, final


def test_auto_hermes_stream_and_message() -> None:
    out = ChoiceToolOutput(parse_chat_tools({"tools": [WEATHER]}), "hermes")
    text, deltas, reason = run(out, ["Checking.", "<tool", '_call>{"name": "get_weather", ',
                                     '"arguments": {"city": "Oslo"}}</tool_call>'], "stop")
    assert text == "Checking." and reason == "tool_calls"
    assert [d.to_openai()["function"] for d in deltas] == [{"name": "get_weather", "arguments": ""},
                                                           {"arguments": '{"city": "Oslo"}'}]
    msg = out.message()
    assert msg["content"] == "Checking." and msg["tool_calls"][0]["function"]["name"] == "get_weather"


def test_required_named_and_cut() -> None:
    required = ChoiceToolOutput(parse_chat_tools({"tools": [WEATHER], "tool_choice": "required"}), None)
    text, deltas, reason = run(
        required, ['[{"name": "get_weather", ', '"parameters": {"city": "Rome"}}]'], "stop"
    )
    assert text == "" and reason == "tool_calls" and required.message()["content"] is None
    assert json.loads(required.message()["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    named = ChoiceToolOutput(parse_chat_tools({"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}), None)
    text, deltas, reason = run(named, ['{"city": ', '"Bern"}'], "stop")
    assert reason == "tool_calls" and "".join(d.arguments for d in deltas) == '{"city": "Bern"}'
    cut = ChoiceToolOutput(parse_chat_tools({"tools": [WEATHER], "tool_choice": "required"}), None)
    text, deltas, reason = run(cut, ['[{"name": "get_w'], "length")
    assert (text, deltas, reason) == ('[{"name": "get_w', [], "length") and cut.message() == {
        "role": "assistant", "content": '[{"name": "get_w'}


def test_none_and_plain_auto_text() -> None:
    none = ChoiceToolOutput(parse_chat_tools({"tools": [WEATHER], "tool_choice": "none"}), "hermes")
    assert run(none, ["<tool_call>x"], "stop") == ("<tool_call>x", [], "stop")
    auto = ChoiceToolOutput(parse_chat_tools({"tools": [WEATHER]}), "hermes")
    assert (
        run(auto, ["Just text."], "stop") == ("Just text.", [], "stop")
        and auto.message()["content"] == "Just text."
    )


def test_chunk_shape() -> None:
    out = ChoiceToolOutput(parse_chat_tools({"tools": [WEATHER], "tool_choice": "required"}), None)
    _, deltas, _ = run(out, ['[{"name": "get_weather", "parameters": {"city": "X"}}]'], "stop")
    raw = ChunkFramer("chat.completion.chunk", "chatcmpl-1", 5, "m", False).tool_calls(
        0, dumps([deltas[0].to_openai()]))
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    chunk = json.loads(raw[6:])
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["finish_reason"] is None
    call = chunk["choices"][0]["delta"]["tool_calls"][0]
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")


def feed_each(out: ChoiceToolOutput, tokens: list[str], reason: str) -> tuple[list[list[dict]], str | None]:
    pieces = []
    for t in tokens:
        content, deltas = out.feed(t)
        assert content == ""
        pieces.append([d.to_openai() for d in deltas])
    content, deltas, final = out.finish(reason)
    return [*pieces, [d.to_openai() for d in deltas]], final


ARGS_TOKENS = ['"', "city", '": "', "Ro", "me", '"}']


def test_required_streams_arguments_per_token() -> None:
    out = ChoiceToolOutput(parse_chat_tools({"tools": [WEATHER], "tool_choice": "required"}), None)
    head = ['[{"', "name", '": "', "get", "_weather", '", "', "parameters", '": {']
    pieces, reason = feed_each(out, head + ARGS_TOKENS + ["}]"], "stop")
    assert pieces[: len(head) - 1] == [[]] * (len(head) - 1)
    header, first = pieces[len(head) - 1]
    assert header["function"] == {"name": "get_weather", "arguments": ""} and first["function"] == {
        "arguments": "{"
    }
    assert pieces[len(head) :] == [[{"index": 0, "function": {"arguments": t}}] for t in ARGS_TOKENS] + [
        [],
        [],
    ]
    assert (
        reason == "tool_calls"
        and out.message()["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    )


def test_named_streams_arguments_per_token_and_a_cut_call_stays() -> None:
    named = {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    out = ChoiceToolOutput(parse_chat_tools(named), None)
    pieces, reason = feed_each(out, ["{", *ARGS_TOKENS], "stop")
    header, first = pieces[0]
    assert header["function"] == {"name": "get_weather", "arguments": ""} and first["function"] == {
        "arguments": "{"
    }
    assert pieces[1:] == [[{"index": 0, "function": {"arguments": t}}] for t in ARGS_TOKENS] + [[]]
    assert reason == "tool_calls" and out.message() == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": header["id"],
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            }
        ],
    }
    # max_tokens cut it after its arguments started: the call stays, "length" (as OpenAI answers)
    cut = ChoiceToolOutput(parse_chat_tools(named), None)
    pieces, reason = feed_each(cut, ["{", *ARGS_TOKENS[:4]], "length")
    assert reason == "length" and cut.message()["content"] is None
    assert cut.message()["tool_calls"][0]["function"]["arguments"] == '{"city": "Ro'
