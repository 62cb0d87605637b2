"""IncrementalDetokenizer and DecodeTable: golden cases per implementation, an independent whole-sequence
oracle, and compiled-vs-Python differential tests (Hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ._impls import IMPL_IDS, IMPLS, compiled, python

FFFD = "\ufffd"

# A small table: 0 'a', 1 ' b', 2-4 the bytes of 很 (E5 BE 88) as raw byte-level tokens, 5-7 the same
# bytes as byte-fallback tokens, 8 '<s>' special, 9 ' ' (space), 10 '\xff' invalid byte, 11 '\xf0\x9f' (half
# of
# an emoji), 12 '\xa4\x97' (its other half: 🤗 = F0 9F A4 97), 13 fallback <0x20>, 14 fallback <0xFF>.
TOKENS = [b"a", b" b", b"\xe5", b"\xbe", b"\x88", b"\xe5", b"\xbe", b"\x88", b"<s>", b" ", b"\xff",
          b"\xf0\x9f", b"\xa4\x97", b" ", b"\xff"]
SPECIAL = frozenset({8})
FALLBACK = frozenset({5, 6, 7, 13, 14})


def make(impl, strip=False, fallback=FALLBACK):
    return impl.IncrementalDetokenizer(impl.DecodeTable(TOKENS, SPECIAL, strip, fallback))


def steps(detok, ids):
    return [detok.feed([i]) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
class TestGolden:
    def test_multibyte_char_emitted_when_its_last_byte_arrives(self, impl):
        assert steps(make(impl), [0, 2, 3, 4, 0]) == ["a", "", "", "很", "a", ""]

    def test_four_byte_emoji_split_in_two_tokens(self, impl):
        assert steps(make(impl), [11, 12]) == ["", "🤗", ""]

    def test_invalid_byte_is_replaced_at_once(self, impl):
        assert steps(make(impl), [10, 0]) == [FFFD, "a", ""]

    def test_incomplete_tail_becomes_fffd_when_next_byte_cannot_continue(self, impl):
        assert steps(make(impl), [2, 3, 0]) == ["", "", FFFD + "a", ""]

    def test_incomplete_tail_at_end_flushes_as_one_fffd(self, impl):
        assert steps(make(impl), [0, 2, 3]) == ["a", "", "", FFFD]

    def test_stray_continuation_bytes_each_replaced(self, impl):
        assert steps(make(impl), [3, 4]) == [FFFD, FFFD, ""]

    def test_special_and_unknown_ids_are_skipped(self, impl):
        assert steps(make(impl), [8, 0, 8, 99, -1, 1]) == ["", "a", "", "", "", " b", ""]

    def test_burst_feed(self, impl):
        d = make(impl)
        assert d.feed([0, 2, 3]) == "a"
        assert d.feed((4, 1)) == "很 b"
        assert d.feed(iter([11])) == ""
        assert d.flush() == FFFD

    def test_strip_leading_space_once(self, impl):
        assert steps(make(impl, strip=True), [1, 1]) == ["b", " b", ""]

    def test_strip_after_skipped_special(self, impl):
        assert steps(make(impl, strip=True), [8, 9, 1]) == ["", "", " b", ""]

    def test_strip_applies_to_byte_fallback_space(self, impl):
        # tokenizers: [<0x20>, '▁Hello'] decodes to ' Hello' (one of the two spaces stripped).
        assert steps(make(impl, strip=True), [13, 1]) == ["", " b", ""]

    def test_no_strip_when_first_char_is_not_space(self, impl):
        assert steps(make(impl, strip=True), [0, 1]) == ["a", " b", ""]

    def test_valid_fallback_run_decodes_when_run_ends(self, impl):
        assert steps(make(impl), [0, 5, 6, 7, 0]) == ["a", "", "", "", "很a", ""]

    def test_valid_fallback_run_at_end(self, impl):
        assert steps(make(impl), [5, 6, 7]) == ["", "", "", "很"]

    def test_incomplete_fallback_run_gives_one_fffd_per_byte(self, impl):
        # tokenizers ByteFallback: [<0xE5>, <0xBE>, '▁Hello'] -> '�� Hello' (not one U+FFFD).
        assert steps(make(impl), [5, 6, 1]) == ["", "", FFFD * 2 + " b", ""]

    def test_run_with_complete_char_then_invalid_is_all_fffd(self, impl):
        # tokenizers: [E5 BE 88 E5, '▁Hello'] -> '���� Hello'
        assert steps(make(impl), [5, 6, 7, 5, 1]) == ["", "", "", "", FFFD * 4 + " b", ""]

    def test_definitely_invalid_run_is_emitted_at_once(self, impl):
        assert steps(make(impl), [5, 14, 14, 0]) == ["", FFFD * 2, FFFD, "a", ""]

    def test_special_inside_run_does_not_end_it(self, impl):
        assert steps(make(impl), [5, 8, 6, 7, 0]) == ["", "", "", "", "很a", ""]

    def test_flush_twice_is_empty(self, impl):
        d = make(impl)
        d.feed([0])
        assert d.flush() == ""
        assert d.flush() == ""

    def test_table_decode_and_len(self, impl):
        t = impl.DecodeTable(TOKENS, SPECIAL, True, FALLBACK)
        assert len(t) == len(TOKENS)
        assert t.decode([8, 1, 2, 3, 4]) == "b很"
        assert t.token_bytes[1] == b" b" and t.special_ids == SPECIAL and t.strip_leading_space is True
        assert t.byte_fallback_ids == FALLBACK

    def test_fallback_id_must_be_one_byte(self, impl):
        with pytest.raises(ValueError):
            impl.DecodeTable(TOKENS, SPECIAL, False, frozenset({1}))


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", 0),
        (b"abc", 3),
        (b"a\xe5", 1),
        (b"a\xe5\xbe", 1),
        (b"a\xe5\xbe\x88", 4),
        (b"\xf0\x9f\xa4", 0),
        (b"\xf0\x9f\xa4\x97", 4),
        (b"\xe0\x80", 2),  # E0 must be followed by A0..BF: decided now
        (b"\xed\xa0", 2),  # surrogate range: invalid
        (b"\xf4\x90", 2),  # above U+10FFFF
        (b"\xc0", 1),  # never a lead byte
        (b"\x80\x80\x80", 3),
        (b"x\xf0\x90\x80", 1),
    ],
)
def test_utf8_complete_prefix_len(impl, data, expected):
    assert impl.utf8_complete_prefix_len(data) == expected


def oracle_decode(tokens, special, strip, fallback, ids):
    """Independent model of tokenizers' decode: skip specials, byte-fallback runs all-or-nothing,
    everything else one lossy UTF-8 stream, then strip one leading space."""
    parts: list[str] = []
    stream = bytearray()
    run = bytearray()

    def end_run():
        if run:
            try:
                stream.extend(run.decode("utf-8").encode())
            except UnicodeDecodeError:
                stream.extend((FFFD * len(run)).encode())
            run.clear()

    for i in ids:
        if not 0 <= i < len(tokens) or i in special:
            continue
        if i in fallback:
            run.extend(tokens[i])
        else:
            end_run()
            stream.extend(tokens[i])
    end_run()
    parts.append(stream.decode("utf-8", "replace"))
    text = "".join(parts)
    if strip and text.startswith(" "):
        text = text[1:]
    return text


BYTES = st.binary(min_size=0, max_size=4) | st.sampled_from(
    [b"\xe5", b"\xbe", b"\x88", b"\xf0", b"\x9f", b"\xa4\x97", b"\xe4\xbd", b"\xa0", b" ", b"\xed", b"\xf4"]
)


@st.composite
def table_and_feeds(draw):
    tokens = draw(st.lists(BYTES, min_size=1, max_size=24))
    n = len(tokens)
    one_byte = [i for i, b in enumerate(tokens) if len(b) == 1]
    fallback = frozenset(draw(st.lists(st.sampled_from(one_byte), max_size=8))) if one_byte else frozenset()
    special = frozenset(draw(st.lists(st.integers(0, n - 1), max_size=3)))
    strip = draw(st.booleans())
    ids = draw(st.lists(st.integers(-1, n), max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=10)))
    return tokens, special, strip, fallback, ids, cuts


def run_feeds(impl, tokens, special, strip, fallback, ids, cuts):
    d = impl.IncrementalDetokenizer(impl.DecodeTable(tokens, special, strip, fallback))
    out, prev = [], 0
    for c in [*cuts, len(ids)]:
        out.append(d.feed(ids[prev:c]))
        prev = c
    out.append(d.flush())
    return out


@pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
@settings(max_examples=300, deadline=None)
@given(case=table_and_feeds())
def test_joined_deltas_equal_oracle(impl, case):
    tokens, special, strip, fallback, ids, _ = case
    deltas = run_feeds(impl, *case)
    assert "".join(deltas) == oracle_decode(tokens, special, strip, fallback, ids)
    for d in deltas:
        d.encode("utf-8")  # no lone surrogates


@pytest.mark.skipif(compiled is None, reason="compiled hot path not built")
@settings(max_examples=300, deadline=None)
@given(case=table_and_feeds())
def test_differential_compiled_vs_python(case):
    assert run_feeds(compiled, *case) == run_feeds(python, *case)


@pytest.mark.skipif(compiled is None, reason="compiled hot path not built")
def test_compiled_detokenizer_accepts_python_table():
    t = python.DecodeTable(TOKENS, SPECIAL, True, FALLBACK)
    d = compiled.IncrementalDetokenizer(t)
    assert d.feed([8, 1, 2, 3, 4, 5, 6, 7]) + d.flush() == "b很很"
