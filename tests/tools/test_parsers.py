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
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "hermes",
        ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
        '{"name": "b", "arguments": {"y": [1, 2]}}\n</tool_call>'),
        None,
        [("a", {"x": 1}), ("b", {"y": [1, 2]})],
    ),
    (
        "hermes",
        "Plain answer with < and <tool and </tool_call> bits.",
        "Plain answer with < and <tool and </tool_call> bits.",
        [],
    ),
    # Streamed once its arguments started: the call stays, with the arguments text that came (cut).
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>', None, [("f", '{"a": 1')]),
    # Not a call before anything was streamed: content, marker included.
    (
        "hermes",
        '<tool_call>{"name": f, "arguments": {"a": 1}}</tool_call>',
        '<tool_call>{"name": f, "arguments": {"a": 1}}</tool_call>',
        [],
    ),
    # Not the streamed shape (no arguments object after the name): sent whole when it closes.
    ("hermes", 'Hi <tool_call>{"name": "f", "extra": {}}</tool_call>', "Hi", [("f", {})]),
    (
        "hermes",
        '<tool_call>{"arguments": {"a": [1, "}"]}, "name": "f"}</tool_call>',
        None,
        [("f", {"a": [1, "}"]})],
    ),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call> done',
        "done",
        [("f", {"a": 2})],
    ),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"q": "ü"}}',
        None,
        [("f", {"q": "ü"})],
    ),  # unclosed at EOS
    ("hermes", "Trailing spaces kept  \n", "Trailing spaces kept  \n", []),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        None,
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": "v"}}',
        None,
        [("a", {}), ("b", {"k": "v"})],
    ),
    ("llama3_json", 'The answer is {"name": "x"}', 'The answer is {"name": "x"}', []),
    ("llama3_json", '{"name": "a", "parameters": {"k": ', None, [("a", '{"k": ')]),  # cut by max_tokens
    (
        "mistral",
        'Sure. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
        "Sure.",
        [("a", {"x": 1}), ("b", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]time[ARGS]{}',
        None,
        [("get_weather", {"city": "Rome"}), ("time", {})],
    ),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    ("mistral", "[TOOL_CALL is not the marker", "[TOOL_CALL is not the marker", []),
]


@pytest.mark.parametrize(("name", "text", "content", "expected"), CASES)
def test_parse_and_every_chunking_agree(name: str, text: str, content: str | None, expected: list) -> None:
    """``expected`` arguments: an object (the JSON text must parse to it) or the exact (cut) text."""

    def args(text: str, want: object) -> object:
        return json.loads(text) if isinstance(want, dict) else text

    result = get_parser(name).parse(text)
    assert result.content == content
    assert [(c.name, args(c.arguments, w)) for c, (_, w) in zip(result.tool_calls, expected)] == expected
    assert len({c.id for c in result.tool_calls}) == len(result.tool_calls) == len(expected)
    for pieces in chunkings(text, seed=len(text)):
        streamed, calls, _ = stream(name, pieces)
        assert streamed == (content or "")
        assert [(c["name"], args(c["arguments"], w)) for c, (_, w) in zip(calls, expected)] == expected
        assert len(calls) == len(expected)
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
    _, deltas = parser.feed(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"z": '
        '0}}</tool_call>'
    )
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


def feed_each(parser: ToolCallParser, tokens: list[str]) -> list[list[dict]]:
    """The OpenAI tool-call deltas of each piece, then of ``flush()``."""
    out = [[d.to_openai() for d in parser.feed(t)[1]] for t in tokens]
    return [*out, [d.to_openai() for d in parser.flush()[1]]]


@pytest.mark.parametrize(
    ("name", "tokens", "head", "tail"),
    [
        (
            "hermes",
            [
                "Sure",
                ".",
                "\n<",
                "tool",
                "_call",
                ">\n",
                '{"',
                "name",
                '":',
                ' "',
                "get",
                "_weather",
                '",',
                ' "',
                "arguments",
                '":',
                ' {"',
            ],
            ' {"',
            ["}\n", "</", "tool", "_call", ">"],
        ),
        (
            "llama3_json",
            ['{"', "name", '":', ' "', "get", "_weather", '",', ' "', "parameters", '":', ' {"'],
            ' {"',
            ["}"],
        ),
        (
            "mistral",
            [
                "[TOOL_CALLS]",
                '[{"',
                "name",
                '":',
                ' "',
                "get",
                "_weather",
                '",',
                ' "',
                "arguments",
                '":',
                ' {"',
            ],
            ' {"',
            ["}]"],
        ),
        (
            "mistral",
            ["[TOOL_CALLS]", "get", "_weather", "[ARGS]", '{"'],
            '{"',
            ["[TOOL_CALLS]", "time", "[ARGS]", "{}"],
        ),
    ],
)
def test_arguments_stream_token_by_token(name: str, tokens: list[str], head: str, tail: list[str]) -> None:
    """Each token inside the arguments object is sent as one fragment, as it comes: the fragments are
    exactly the arguments text of their tokens (nothing repeated, nothing held), and join to the
    final ``arguments``; the header goes out with the token that opens the arguments."""
    args_tokens = ["city", '":', ' "', "Os", "lo", '",', ' "', "q", '":', ' "', 'a}\\"', '{"', "}"]
    parser = get_parser(name)
    per_piece = feed_each(parser, tokens + args_tokens + tail)
    before = per_piece[: len(tokens) - 1]
    assert before == [[]] * (len(tokens) - 1)  # nothing before the arguments start
    header, first = per_piece[len(tokens) - 1]
    assert header["function"] == {"name": "get_weather", "arguments": ""} and header["id"].startswith("call_")
    assert first == {"index": 0, "function": {"arguments": "{\""}}
    fragments = [d for piece in per_piece[len(tokens):] for d in piece if d["index"] == 0]
    assert fragments == [{"index": 0, "function": {"arguments": t}} for t in args_tokens]
    call = parser.tool_calls[0]
    assert [c.name for c in parser.tool_calls] == ["get_weather"] + (["time"] if "time" in tail else [])
    assert call.arguments == '{"' + "".join(args_tokens) == '{"city": "Oslo", "q": "a}\\"{"}'
    assert json.loads(call.arguments) == {"city": "Oslo", "q": 'a}"{'}
    result = get_parser(name).parse("".join(tokens + args_tokens + tail))
    streamed = [(c.name, c.arguments) for c in parser.tool_calls]
    assert [(c.name, c.arguments) for c in result.tool_calls] == streamed


def test_parallel_calls_stream_each_with_its_index() -> None:
    parser = get_parser("hermes")
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {"y": [1, {"z": 2}]}}</tool_call>')
    deltas = [d for piece in feed_each(parser, list(text)) for d in piece]
    assert [d["function"].get("name") for d in deltas if "id" in d] == ["a", "b"]
    for index, args in ((0, '{"x": 1}'), (1, '{"y": [1, {"z": 2}]}')):
        fragments = [d["function"]["arguments"] for d in deltas if d["index"] == index and "id" not in d]
        assert len(fragments) == len(args) and "".join(fragments) == args  # one per character fed
