"""Tag-pair reasoning parsers (``deepseek_r1``, ``qwen3``, ``mistral``) on text deltas: exact values,
the hold-back rule, and any split == one feed, checked against an independent one-shot oracle."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.reasoning import ReasoningResult, ThinkTagParser, get_reasoning_parser, held_prefix_len

OPEN, CLOSE = "<think>", "</think>"


def oracle(text: str, open_tag: str, close_tag: str, in_reasoning: bool) -> tuple[str, str]:
    """The rules of proxy.reasoning.think written as one partition (not the parser's code)."""
    body = text.lstrip()
    if body.startswith(open_tag):
        rest = body[len(open_tag):]
    elif in_reasoning:
        rest = text
    else:
        return "", text
    reasoning, _, content = rest.partition(close_tag)
    return reasoning, content


def stream(parser, pieces) -> tuple[list[str], list[str]]:
    reasoning, content = [], []
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = parser.flush()
    return [*reasoning, r], [*content, c]


def split_at(text: str, cuts) -> list[str]:
    points = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
    ("qwen3", "Paris.", ("", "Paris.")),  # no open and no close tag: all content (vLLM's qwen3)
    ("qwen3", "Paris.</think> tail", ("", "Paris.</think> tail")),  # started as content: stays content
    ("qwen3", "<think>cut by max_tokens", ("cut by max_tokens", "")),  # no close tag: all reasoning
    ("qwen3", "\n <think>a</think>b", ("a", "b")),  # whitespace before the open tag counts with it
    ("qwen3", "<think></think>", ("", "")),  # tags at the very start and the very end
    ("qwen3", "<think>a</think>b</think>c", ("a", "b</think>c")),  # only the first close tag splits
    ("qwen3", "<think>a</think><think>b</think>", ("a", "<think>b</think>")),
    ("deepseek_r1", "Okay, so.</think>\n\n42", ("Okay, so.", "\n\n42")),  # starts inside (R1 prompt)
    ("deepseek_r1", "no close tag at all", ("no close tag at all", "")),  # vLLM's deepseek_r1: reasoning
    ("deepseek_r1", "<think>x</think>y", ("x", "y")),  # an open tag the model wrote itself is consumed
    ("deepseek_r1", "</think>", ("", "")),
    ("mistral", "[THINK]hmm[/THINK]Answer", ("hmm", "Answer")),
    ("mistral", "Answer only", ("", "Answer only")),
    ("mistral", "[THINK]a <think>b</think>[/THINK]c", ("a <think>b</think>", "c")),
])
def test_exact_split(name: str, text: str, expected: tuple[str, str]) -> None:
    assert get_reasoning_parser(name).parse(text) == ReasoningResult(*expected)


@pytest.mark.parametrize("in_reasoning", [False, True])
def test_tool_call_markers_inside_thinking_stay_reasoning_and_after_it_are_content(in_reasoning):
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    text = f"<think>I could emit {call} here</think>\n{call}"
    got = get_reasoning_parser("qwen3", in_reasoning=in_reasoning).parse(text)
    assert got == ReasoningResult(f"I could emit {call} here", f"\n{call}")


def test_explicit_start_overrides_the_formats_default() -> None:
    assert get_reasoning_parser("deepseek_r1", in_reasoning=False).parse("a</think>b") == ReasoningResult(
        "", "a</think>b")
    assert get_reasoning_parser("qwen3", in_reasoning=True).parse("a</think>b") == ReasoningResult("a", "b")


def test_a_close_tag_split_over_deltas_is_held_back_and_never_emitted() -> None:
    p = get_reasoning_parser("qwen3", in_reasoning=True)
    assert p.feed("abc<") == ("abc", "")
    assert p.in_reasoning and not p.reasoning_ended
    assert p.feed("/th") == ("", "")
    assert p.feed("ink") == ("", "")
    assert p.feed(">\n\nHi") == ("", "\n\nHi")
    assert p.reasoning_ended and not p.in_reasoning
    assert p.feed("</think>") == ("", "</think>")
    assert p.flush() == ("", "")


def test_a_held_prefix_that_is_not_a_tag_is_released() -> None:
    p = get_reasoning_parser("qwen3", in_reasoning=True)
    assert p.feed("a </thi") == ("a ", "")
    assert p.feed("s is not it") == ("</this is not it", "")
    assert p.feed("<") == ("", "")
    assert p.flush() == ("<", "")  # the end: a partial tag is text of its field


def test_an_open_tag_split_at_the_start_is_held_until_decided() -> None:
    p = get_reasoning_parser("qwen3")
    assert not p.in_reasoning
    assert p.feed("\n") == ("", "")
    assert p.feed("<th") == ("", "")
    assert p.feed("ink>") == ("", "")
    assert p.in_reasoning
    assert p.feed("x") == ("x", "")
    q = get_reasoning_parser("qwen3")
    assert q.feed("<th") == ("", "")
    assert q.feed("at is") == ("", "<that is")
    assert q.reasoning_ended


def test_held_prefix_len() -> None:
    assert held_prefix_len("abc</thi", ("</think>",)) == 5
    assert held_prefix_len("abc</think", ("</think>",)) == 7
    assert held_prefix_len("abc", ("</think>",)) == 0
    assert held_prefix_len("x<|e", ("<|end|>", "<|call|>")) == 3
    assert held_prefix_len("</think>", ("</think>",)) == 0  # a whole marker is not a partial one


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="<|/>thinkedaTHINK[]", max_size=12),
       markers=st.lists(st.sampled_from(["</think>", "<|end|>", "<|call|>", "[/THINK]", "<", "<<a"]),
                        min_size=1, max_size=3))
def test_held_prefix_len_is_the_longest_proper_prefix_suffix(text: str, markers: list[str]) -> None:
    naive = max((k for m in markers for k in range(1, min(len(text), len(m) - 1) + 1)
                 if m.startswith(text[len(text) - k:])), default=0)
    assert held_prefix_len(text, markers) == naive


def test_empty_tags_are_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        ThinkTagParser("", CLOSE, in_reasoning=False)


FIXED = "  <think>\nI think.</thi</think>\n\nThe <think> answer</think>!"


def test_every_two_and_three_way_split_of_a_fixed_text_is_the_one_shot_result() -> None:
    for in_reasoning in (False, True):
        want = oracle(FIXED, OPEN, CLOSE, in_reasoning)
        assert want == ("\nI think.</thi", "\n\nThe <think> answer</think>!")
        n = len(FIXED)
        for i in range(n + 1):
            for j in range(i, n + 1):
                parser = get_reasoning_parser("qwen3", in_reasoning=in_reasoning)
                r, c = stream(parser, split_at(FIXED, (i, j)))
                assert ("".join(r), "".join(c)) == want, (i, j)


FRAGMENTS = ["<think>", "</think>", "<", "</", "<th", "think", "ink>", ">", " ", "\n", "a", "é",
             "<tool_call>", "[THINK]", "[/THINK]", "[/", "TH"]


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=14),
       cuts=st.lists(st.integers(0, 120), max_size=8),
       name=st.sampled_from(["qwen3", "deepseek_r1", "mistral"]), start=st.sampled_from([None, False, True]))
def test_any_split_equals_the_oracle(parts, cuts, name, start) -> None:
    """Equality of the concatenations is also the no-leak check: a tag fragment emitted before the
    tag completed would stay in a field, where the oracle has none."""
    text = "".join(parts)
    parser = get_reasoning_parser(name, in_reasoning=start)
    open_tag, close_tag = ("[THINK]", "[/THINK]") if name == "mistral" else (OPEN, CLOSE)
    in_reasoning = name == "deepseek_r1" if start is None else start
    reasoning, content = stream(parser, split_at(text, cuts))
    assert ("".join(reasoning), "".join(content)) == oracle(text, open_tag, close_tag, in_reasoning)
