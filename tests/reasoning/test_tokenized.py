"""Reasoning parsers on real token streams: each token's text from the hot-path detokenizer (both
twins), with the parser's markers kept where they are special tokens, fed one token at a time."""

from __future__ import annotations

import functools

import pytest
from hotpath._impls import IMPL_IDS, IMPLS
from testdata import zoo_path

from proxy.reasoning import ReasoningResult, get_reasoning_format, get_reasoning_parser
from proxy.tokenizer import Tokenizer

from .fixtures import make_harmony_tokenizer, make_qwen3_style_tokenizer
from .test_harmony import SEQUENCE

ZOO = ("gpt-2", "llama-bpe", "llama-spm", "phi-3", "qwen2")
OUTPUT = "<think>\nHmm. 你好 🤗, 2+2=4.</think>\n\nThe answer is 4.</think> 🙂"
WANT = ReasoningResult("\nHmm. 你好 🤗, 2+2=4.", "\n\nThe answer is 4.</think> 🙂")


@functools.cache
def zoo_tokenizer(name: str) -> Tokenizer:
    from transformers import AutoTokenizer

    return Tokenizer(AutoTokenizer.from_pretrained(str(zoo_path(name))))


def token_texts(tok: Tokenizer, ids: list[int], impl, keep: frozenset[int] = frozenset()) -> list[str]:
    """Each token's text as the engine's output path produces it (one ``feed`` per token), with the
    detokenizer twin ``impl`` over the tokenizer's decode table (``keep``: special ids kept as text)."""
    table = tok._table_keeping(keep) if keep else tok.decode_table
    assert table is not None, tok.decode_path
    table = impl.DecodeTable(list(table.token_bytes), frozenset(table.special_ids), table.strip_leading_space,
                             frozenset(table.byte_fallback_ids))
    detok = impl.IncrementalDetokenizer(table)
    texts = [detok.feed([i]) for i in ids]
    texts[-1] += detok.flush()
    return texts


def run(name: str, texts: list[str], in_reasoning: bool | None = None) -> ReasoningResult:
    """One token's text per ``feed``, then ``flush``; the deltas concatenated."""
    parser = get_reasoning_parser(name, in_reasoning=in_reasoning)
    deltas = [parser.feed(t) for t in texts] + [parser.flush()]
    return ReasoningResult("".join(r for r, _ in deltas), "".join(c for _, c in deltas))


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("zoo", ZOO)
def test_plain_text_tags_split_across_tokens(zoo: str, impl) -> None:
    tok = zoo_tokenizer(zoo)
    for tag in ("<think>", "</think>"):
        assert 2 <= len(tok.encode(tag, add_special_tokens=False)) <= 4, (zoo, tag)
    ids = tok.encode(OUTPUT, add_special_tokens=False)
    texts = token_texts(tok, ids, impl)
    assert "".join(texts) == tok.decode(ids) == OUTPUT
    for start in (None, False, True):  # the open tag is at the very start: consumed either way
        got = run("qwen3", texts, start)
        assert got == WANT, zoo
        assert get_reasoning_parser("qwen3").parse(OUTPUT) == WANT
    # a token that straddles reasoning and tag, and tag and content (qwen2: ".</" and ">\n\n")
    if zoo == "qwen2":
        assert ".</" in texts and ">\n\n" in texts


@pytest.mark.parametrize("start", [False, True])
@pytest.mark.parametrize("zoo", ["qwen2", "llama-spm"])
def test_reasoning_tokens_are_the_tokens_that_start_inside_the_reasoning(zoo: str, start: bool) -> None:
    """Counting the tokens with ``in_reasoning`` True before their feed == the tokens whose text starts
    after the open tag and before the end of the close tag (independent: character offsets)."""
    tok = zoo_tokenizer(zoo)
    text = OUTPUT[len("<think>"):] if start else OUTPUT  # a prompt that opened the thinking: no open tag
    ids = tok.encode(text, add_special_tokens=False)
    texts = token_texts(tok, ids, IMPLS[0])
    parser = get_reasoning_parser("qwen3", in_reasoning=start)
    counted = 0
    for t in texts:
        counted += parser.in_reasoning
        parser.feed(t)
    begin = 0 if start else len("<think>")
    end = text.index("</think>") + len("</think>")
    offsets = [sum(map(len, texts[:i])) for i in range(len(texts))]
    assert counted == sum(begin <= o < end for o in offsets) > 3


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("zoo", ["qwen2", "llama-spm"])
def test_no_close_tag_and_a_prompt_that_opened_the_thinking(zoo: str, impl) -> None:
    tok = zoo_tokenizer(zoo)
    text = "Okay, the user asks </thin"  # max_tokens cut inside the thinking, in the middle of the tag
    texts = token_texts(tok, tok.encode(text, add_special_tokens=False), impl)
    assert run("deepseek_r1", texts) == ReasoningResult(text, "")
    assert run("qwen3", texts, in_reasoning=False) == ReasoningResult("", text)


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_mistral_tags_across_tokens(impl) -> None:
    tok = zoo_tokenizer("llama-spm")
    text = "[THINK]a [TOOL_CALLS] b[/THINK]Answer"
    assert len(tok.encode("[/THINK]", add_special_tokens=False)) > 4  # '[', '/', 'TH', 'IN', 'K', ']'
    texts = token_texts(tok, tok.encode(text, add_special_tokens=False), impl)
    assert run("mistral", texts) == ReasoningResult("a [TOOL_CALLS] b", "Answer")


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_think_as_special_tokens_needs_the_markers_kept(impl) -> None:
    """``<think>`` / ``</think>`` as special tokens: ``decode(skip_special_tokens=True)`` drops them, so
    the API keeps ``marker_texts`` (``special_ids_of``); as added non-special tokens (Qwen3's
    vocabulary) they are text already."""
    hf = make_qwen3_style_tokenizer("special")
    tok = Tokenizer(hf)
    markers = get_reasoning_format("qwen3").marker_texts
    keep = tok.special_ids_of(markers)
    assert keep == {hf.convert_tokens_to_ids("<think>"), hf.convert_tokens_to_ids("</think>")}
    body = "Let me think.\n<tool_call>\n{}\n</tool_call>"
    text = f"{body}</think>\n\nHello!\n<tool_call>\n{{}}\n</tool_call>"
    ids = tok.encode(text, add_special_tokens=False)
    assert hf.convert_tokens_to_ids("</think>") in ids
    want = ReasoningResult(body, "\n\nHello!\n<tool_call>\n{}\n</tool_call>")
    assert run("qwen3", token_texts(tok, ids, impl, keep), in_reasoning=True) == want
    dropped = token_texts(tok, ids, impl)  # without keeping: the split point is gone
    assert run("qwen3", dropped, in_reasoning=True) == ReasoningResult("".join(dropped), "")
    added = Tokenizer(make_qwen3_style_tokenizer("added"))
    assert added.special_ids_of(markers) == frozenset()
    ids = added.encode(text, add_special_tokens=False)
    assert run("qwen3", token_texts(added, ids, impl), in_reasoning=True) == want
    plain = Tokenizer(make_qwen3_style_tokenizer("plain"))  # not in the vocabulary: several tokens each
    ids = plain.encode(text, add_special_tokens=False)
    assert len(ids) > len(added.encode(text, add_special_tokens=False)) + 4
    assert run("qwen3", token_texts(plain, ids, impl), in_reasoning=True) == want


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
def test_harmony_markers_as_special_tokens(impl) -> None:
    hf = make_harmony_tokenizer()
    tok = Tokenizer(hf)
    markers = get_reasoning_format("gpt_oss").marker_texts
    keep = tok.special_ids_of(markers)
    assert keep == {hf.convert_tokens_to_ids(m) for m in markers}
    ids = tok.encode(SEQUENCE, add_special_tokens=False)
    texts = token_texts(tok, ids, impl, keep)
    assert "".join(texts) == SEQUENCE
    got = run("gpt_oss", texts)
    assert got == get_reasoning_parser("gpt_oss").parse(SEQUENCE)
    assert got.reasoning == "User wants weather. Use the tool. Got it."
    assert got.content.endswith("It is sunny.")
