"""The GPT-OSS harmony parser: the channel sequence, tool-call messages kept whole out of the
reasoning, non-harmony output, and any split == one feed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.reasoning import HarmonyParser, ReasoningResult, get_reasoning_parser
from proxy.reasoning.harmony import MAX_HEADER_CHARS

from .test_think import split_at, stream

ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"
CALL_HEADER = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"

SEQUENCE = (f"{ANALYSIS}User wants weather. Use the tool.<|end|>"
            f"<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"  # a preamble: content
            f"{CALL_HEADER}" '{"city": "Oslo"}<|call|>'
            f"<|start|>assistant<|channel|>analysis<|message|> Got it.<|end|>"
            f"{FINAL}It is sunny.")


def test_the_channel_sequence() -> None:
    got = get_reasoning_parser("gpt_oss").parse(SEQUENCE)
    assert got == ReasoningResult(
        "User wants weather. Use the tool. Got it.",
        "Checking." + CALL_HEADER + '{"city": "Oslo"}<|call|>' + "It is sunny.",
    )


def test_analysis_then_final_and_the_flags() -> None:
    p = HarmonyParser()
    assert not p.in_reasoning
    assert p.feed("<|channel|>anal") == ("", "")
    assert p.feed("ysis<|message|>Hmm") == ("Hmm", "")
    assert p.in_reasoning and not p.reasoning_ended
    assert p.feed(".<|e") == (".", "")  # a partial terminator is held
    assert p.feed("nd|><|start|>assistant<|chan") == ("", "")
    assert p.feed("nel|>final<|message|>4") == ("", "4")
    assert p.reasoning_ended and not p.in_reasoning
    assert p.feed("2") == ("", "2")
    assert p.flush() == ("", "")


def test_a_call_right_after_the_role_keeps_its_header_verbatim() -> None:
    text = ' to=functions.f<|channel|>commentary json<|message|>{"a": 1}'
    assert HarmonyParser().parse(text) == ReasoningResult("", text)


def test_a_cut_inside_the_reasoning_gives_reasoning_only() -> None:
    assert HarmonyParser().parse(f"{ANALYSIS}still thinking <|") == ReasoningResult("still thinking <|", "")
    assert HarmonyParser().parse(f"{ANALYSIS}done<|end|><|start|>assistant<|chan") == ReasoningResult(
        "done", "")  # a header the output ended inside is markup


def test_a_prompt_that_opened_the_analysis_starts_in_the_reasoning() -> None:
    p = get_reasoning_parser("openai_gptoss", in_reasoning=True)  # vLLM's name, same parser
    assert p.in_reasoning
    assert p.parse(f"thinking<|end|>{FINAL}answer") == ReasoningResult("thinking", "answer")


@pytest.mark.parametrize("text", ["Plain answer, no harmony.", "\n<|channel|>final<|message|>x",
                                  "<|channel|>" + "x" * (MAX_HEADER_CHARS + 1) + "<|message|>y"])
def test_output_that_is_not_harmony_is_content_unchanged(text: str) -> None:
    assert HarmonyParser().parse(text) == ReasoningResult("", text)


def test_after_a_message_text_that_is_no_header_is_content() -> None:
    assert HarmonyParser().parse(f"{ANALYSIS}r<|end|>oops") == ReasoningResult("r", "oops")


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(SEQUENCE)), max_size=12))
def test_any_split_of_the_sequence_is_the_one_shot_result(cuts) -> None:
    want = HarmonyParser().parse(SEQUENCE)
    reasoning, content = stream(HarmonyParser(), split_at(SEQUENCE, cuts))
    assert ReasoningResult("".join(reasoning), "".join(content)) == want


PIECES = ["<|channel|>", "analysis", "final", "commentary", " to=functions.f", "<|message|>", "<|end|>",
          "<|call|>", "<|start|>", "assistant", "<|", "|>", "<", "a", " ", "é", "<|constrain|>json"]


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(PIECES), max_size=16), cuts=st.lists(st.integers(0, 200), max_size=8),
       start=st.booleans())
def test_any_split_of_random_harmony_is_the_one_shot_result(parts, cuts, start) -> None:
    text = "".join(parts)
    want = HarmonyParser(in_reasoning=start).parse(text)
    reasoning, content = stream(HarmonyParser(in_reasoning=start), split_at(text, cuts))
    assert ReasoningResult("".join(reasoning), "".join(content)) == want
    assert len(want.reasoning) + len(want.content) <= len(text)
