"""Tool-call parsers: formats, markers split across chunks, parallel calls, invalid JSON as content."""

from __future__ import annotations

import json
import random

import pytest

from proxy.tools import PARSERS, ToolCallParser, detect_parser, get_parser


def stream(name: str, pieces: list[str]) -> tuple[str, list[dict], ToolCallParser]:
    """Feed pieces; return the streamed content, the calls rebuilt from deltas, and the parser."""
    parser = get_parser(name)
    content: list[str] = []
    calls: dict[int, dict] = {}
    for piece in [*pieces, None]:
        text, deltas = parser.feed(piece) if piece is not None else parser.flush()
        content.append(text)
        for d in deltas:
            o = d.to_openai()
            if "id" in o:
                assert o["index"] not in calls and o["type"] == "function" and o["id"].startswith("call_")
                calls[o["index"]] = {"id": o["id"], "name": o["function"]["name"], "arguments": ""}
            calls[o["index"]]["arguments"] += o["function"]["arguments"]
    return "".join(content), [calls[i] for i in sorted(calls)], parser


def chunkings(text: str, seed: int) -> list[list[str]]:
    """Every-character, whole, and random chunkings of ``text``."""
    rng = random.Random(seed)
    out = [list(text), [text]]
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


CASES = [
    # (parser, output text, expected content, expected [(name, arguments object)])
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {"y": [1, 2]}}\n</tool_call>', None, [("a", {"x": 1}), ("b", {"y": [1, 2]})]),
    ("hermes", "Plain answer with < and <tool and </tool_call> bits.", "Plain answer with < and <tool and </tool_call> bits.", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>', []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call> done', "done", [("f", {"a": 2})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"q": "ü"}}', None, [("f", {"q": "ü"})]),  # unclosed at EOS
    ("hermes", "Trailing spaces kept  \n", "Trailing spaces kept  \n", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": "v"}}', None,
     [("a", {}), ("b", {"k": "v"})]),
    ("llama3_json", 'The answer is {"name": "x"}', 'The answer is {"name": "x"}', []),
    ("llama3_json", '{"name": "a", "parameters": {"k": ', '{"name": "a", "parameters": {"k": ', []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
     "Sure.", [("a", {"x": 1}), ("b", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]time[ARGS]{}', None,
     [("get_weather", {"city": "Rome"}), ("time", {})]),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    ("mistral", "[TOOL_CALL is not the marker", "[TOOL_CALL is not the marker", []),
]


@pytest.mark.parametrize(("name", "text", "content", "expected"), CASES)
def test_parse_and_every_chunking_agree(name: str, text: str, content: str | None, expected: list) -> None:
    result = get_parser(name).parse(text)
    assert result.content == content
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == expected
    assert len({c.id for c in result.tool_calls}) == len(expected)
    for pieces in chunkings(text, seed=len(text)):
        streamed, calls, _ = stream(name, pieces)
        assert streamed == (content or "")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected
        assert [c["arguments"] for c in calls] == [c.arguments for c in result.tool_calls]


@pytest.mark.parametrize("name", PARSERS)
def test_no_partial_marker_leaks(name: str) -> None:
    """While a marker is incomplete, none of its characters are shown as content."""
    marker = get_parser(name).marker_text
    parser = get_parser(name)
    shown = parser.feed("Hi ")[0] if name != "llama3_json" else ""
    for ch in marker:
        shown += parser.feed(ch)[0]
        assert marker[:1] not in shown[len("Hi"):] if name != "llama3_json" else shown == ""
    payload = '{"name": "f", "arguments": {}}' if name != "llama3_json" else '{"name": "f", "parameters": {}}'
    for ch in payload:
        shown += parser.feed(ch)[0]
    if name == "hermes":
        for ch in "</tool_call>":
            shown += parser.feed(ch)[0]
    text, deltas = parser.flush()
    shown += text
    assert shown == ("Hi" if name != "llama3_json" else "")
    assert [d.name for d in deltas if d.name] == ["f"] or [c.name for c in parser.tool_calls] == ["f"]


def test_held_prefix_released_when_not_a_marker() -> None:
    parser = get_parser("hermes")
    assert parser.feed("a <tool")[0] == "a"
    assert parser.feed("s are great")[0] == " <tools are great"


def test_delta_shape_and_indices() -> None:
    parser = get_parser("hermes")
    _, deltas = parser.feed('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"z": 0}}</tool_call>')
    dicts = [d.to_openai() for d in deltas]
    assert [d["index"] for d in dicts] == [0, 0, 1, 1]
    assert dicts[0]["function"] == {"name": "a", "arguments": ""} and dicts[0]["type"] == "function"
    assert dicts[1] == {"index": 0, "function": {"arguments": "{}"}}
    assert dicts[3] == {"index": 1, "function": {"arguments": '{"z": 0}'}}
    assert parser.tool_calls[1].to_openai()["function"] == {"name": "b", "arguments": '{"z": 0}'}


def test_unknown_parser() -> None:
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        get_parser("nope")


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% if tools %}<tools></tools>{% endif %}<tool_call>", "hermes"),
        ("{% for tool in tools %}[AVAILABLE_TOOLS]{% endfor %}[TOOL_CALLS]", "mistral"),
        ("{%- if tools %}<|python_tag|>{{ tool }}{% endif %}", "llama3_json"),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", None),
        (None, None),
    ],
)
def test_detect_parser(template: str | None, expected: str | None) -> None:
    assert detect_parser(template) == expected
