"""The decode table of a tokenizer, its verification, and the exact fallback detokenizer.

A :class:`proxy.hotpath.DecodeTable` gives, for every token id, the exact bytes it contributes
(byte-level BPE: GPT-2, Llama 3, Qwen2, SmolLM2; SentencePiece with byte fallback: Llama 2, Phi-3;
Metaspace). It is verified against ``tokenizer.decode`` on :data:`VERIFY_CORPUS`, every added token
and random id sequences. When the decoder cannot be expressed as a table (WordPiece ``##``,
``clean_up_tokenization_spaces``, an unknown decoder, or a failed verification),
:class:`RedecodeDetokenizer` is the exact but slower fallback. ``proxy.tokenizer.Tokenizer`` chooses.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from proxy import hotpath

__all__ = [
    "VERIFY_CORPUS",
    "Detokenizer",
    "RedecodeDetokenizer",
    "build_decode_table",
    "bytes_to_unicode",
    "skipped_special_ids",
    "verify_decode_table",
]

logger = logging.getLogger(__name__)

#: Built-in multilingual corpus the decode table is verified on (plus added tokens and random ids).
VERIFY_CORPUS: tuple[str, ...] = (
    "Hello, world! This is a test.",
    " leading space, trailing space ",
    "  two leading spaces and\ttabs\tand\nnew\nlines\r\n\n",
    ("vLLM is a high-throughput engine for LLMs. It is designed for production. Don't stop; it's 3.5x faster "
    ", really ."),
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": None}  # comment\n",
    "你是谁？请用中文详细介绍你自己，至少三句话。",
    "我很感动，遐迩闻名的𠮷野家和龘字。",
    "日本語のテキスト、カタカナとひらがな。",
    "삼겹살 감사합니다 한국어 문장입니다.",
    "🤗😄🙂 👨‍👩‍👧‍👦 🇯🇵 🛑 emoji ✨",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "مرحبا بالعالم، هذا اختبار.",
    "नमस्ते दुनिया, यह एक परीक्षण है।",
    "สวัสดีชาวโลก นี่คือการทดสอบ",
    "Ελληνικά: αβγδε. Ñandú, café, naïve, Zürich, Øresund, Łódź.",
    "∑∫√∞ ≤≥ ½ ¾ € £ ¥ ™ © ® … — – “quotes” ‘single’ « » ¿¡",
    "e\u0301 combining a\u0308 marks, zero\u200bwidth, nbsp\u00a0here, \u2028line sep",
    "abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyz https://example.com/a?b=c&d=e#f",
    "1234567890 3.14159 -42 1e-9 0x1F",
    " ",
    "\n",
    "A",
)


class Detokenizer(Protocol):
    """What ``Tokenizer.new_detokenizer()`` returns: the hot path's incremental detokenizer or the
    fallback."""

    def feed(self, ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to U+0100 onwards in byte order
    (Radford et al. 2019, GPT-2 ``encoder.py``; the ``tokenizers`` ByteLevel decoder reverses it).
    """
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _decoder_spec(hf_tokenizer: Any) -> dict[str, Any] | None:
    backend = getattr(hf_tokenizer, "_tokenizer", None)
    if backend is None or backend.decoder is None:
        return None
    try:
        spec: dict[str, Any] = json.loads(backend.decoder.__getstate__())
        return spec
    except Exception:  # noqa: BLE001 - an unknown decoder simply means "not a table"
        return None


def _spm_shape(spec: dict[str, Any]) -> tuple[bool, bool] | None:
    """For a SentencePiece-style decoder: (uses ByteFallback, strips one leading space), else None."""
    if spec.get("type") == "Metaspace":
        if spec.get("replacement") != "\u2581":
            return None
        return False, spec.get("prepend_scheme", "always") != "never"
    if spec.get("type") != "Sequence":
        return None
    parts = spec.get("decoders") or []
    kinds = [p.get("type") for p in parts]
    strip = False
    if kinds and kinds[-1] == "Strip":
        last = parts[-1]
        if last.get("content") != " " or last.get("start") != 1 or last.get("stop") != 0:
            return None
        strip = True
        kinds = kinds[:-1]
        parts = parts[:-1]
    if not kinds or kinds[0] != "Replace":
        return None
    rep = parts[0]
    if rep.get("pattern") != {"String": "\u2581"} or rep.get("content") != " ":
        return None
    rest = kinds[1:]
    if rest == ["ByteFallback", "Fuse"]:
        return True, strip
    if rest in (["Fuse"], []):
        return False, strip
    return None


def skipped_special_ids(hf_tokenizer: Any) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops, found by asking the tokenizer itself."""
    candidates: set[int] = set(getattr(hf_tokenizer, "all_special_ids", []) or [])
    backend = getattr(hf_tokenizer, "_tokenizer", None)
    if backend is not None:
        candidates.update(backend.get_added_tokens_decoder().keys())
    skipped = set()
    for i in sorted(candidates):
        if hf_tokenizer.decode([i], skip_special_tokens=True) == "" and hf_tokenizer.decode(
            [i], skip_special_tokens=False
        ):
            skipped.add(i)
    return frozenset(skipped)


def build_decode_table(hf_tokenizer: Any) -> tuple[hotpath.DecodeTable | None, str]:
    """Derive the decode table of a transformers tokenizer (not yet verified).

    Returns:
        ``(table, description)``; ``table`` is None when the decoder cannot be expressed as a table, and
        the description then says why.
    """
    if getattr(hf_tokenizer, "clean_up_tokenization_spaces", False):
        return None, "clean_up_tokenization_spaces rewrites text across tokens"
    spec = _decoder_spec(hf_tokenizer)
    if spec is None:
        return None, "no fast (tokenizers) decoder"
    backend = hf_tokenizer._tokenizer
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1 if vocab else 0
    pieces: list[str | None] = [None] * size
    for token, i in vocab.items():
        pieces[i] = token
    token_bytes: list[bytes] = [b""] * size
    byte_fallback: set[int] = set()
    strip = False
    if spec.get("type") == "ByteLevel":
        reverse = {c: b for b, c in bytes_to_unicode().items()}
        for i, piece in enumerate(pieces):
            if piece is None:
                continue
            try:
                token_bytes[i] = bytes(reverse[c] for c in piece)
            except KeyError:  # tokenizers keeps such a token's own UTF-8 bytes
                token_bytes[i] = piece.encode()
        kind = "byte-level BPE"
    else:
        shape = _spm_shape(spec)
        if shape is None:
            return None, f"decoder {spec.get('type')} is not expressible as a table"
        uses_byte_fallback, strip = shape
        for i, piece in enumerate(pieces):
            if piece is None:
                continue
            if uses_byte_fallback and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    token_bytes[i] = bytes([int(piece[3:5], 16)])
                    byte_fallback.add(i)
                    continue
                except ValueError:
                    pass
            token_bytes[i] = piece.replace("\u2581", " ").encode()
        kind = (
            "SentencePiece" + (" byte-fallback" if uses_byte_fallback else "") + (" strip" if strip else "")
        )
    table = hotpath.DecodeTable(
        token_bytes, skipped_special_ids(hf_tokenizer), strip, frozenset(byte_fallback)
    )
    return table, kind


def _verification_sequences(hf_tokenizer: Any, table: Any, seed: int = 0) -> list[list[int]]:
    seqs: list[list[int]] = []
    for text in VERIFY_CORPUS:
        seqs.append(list(hf_tokenizer.encode(text, add_special_tokens=True)))
        seqs.append(list(hf_tokenizer.encode(text, add_special_tokens=False)))
    size = len(table.token_bytes)
    hello = list(hf_tokenizer.encode(" Hello world", add_special_tokens=False))
    added = sorted(hf_tokenizer._tokenizer.get_added_tokens_decoder().keys())
    for start in range(0, len(added), 16):
        chunk = added[start : start + 16]
        seqs.append(chunk)
        seqs.append([x for i in chunk for x in (i, *hello)])
    rng = random.Random(seed)
    short = [i for i, b in enumerate(table.token_bytes) if len(b) == 1] or [0]
    specials = sorted(table.special_ids) or [0]
    for _ in range(24):
        seq = []
        for _ in range(48):
            r = rng.random()
            if r < 0.45:
                seq.append(rng.choice(short))
            elif r < 0.5:
                seq.append(rng.choice(specials))
            else:
                seq.append(rng.randrange(size))
        seqs.append(seq)
    seqs.append([size, size + 5, *hello])  # unknown ids decode to nothing
    return seqs


def verify_decode_table(hf_tokenizer: Any, table: Any) -> tuple[str | None, int]:
    """Check the table against ``tokenizer.decode(ids, skip_special_tokens=True)``.

    Feeds each verification sequence one id at a time into an :class:`IncrementalDetokenizer` and compares
    the joined output. Returns ``(first mismatch description or None, number of sequences checked)``.
    """
    seqs = _verification_sequences(hf_tokenizer, table)
    for ids in seqs:
        expected = hf_tokenizer.decode(ids, skip_special_tokens=True)
        detok = hotpath.IncrementalDetokenizer(table)
        got = "".join(detok.feed([i]) for i in ids) + detok.flush()
        if got != expected:
            return f"ids {ids[:24]}...: table gives {got[:60]!r}, decode gives {expected[:60]!r}", len(seqs)
    return None, len(seqs)


_CLEANUP_MAX_HOLD = 4  # longest clean-up pattern (" n't") - all of them start with a space


class RedecodeDetokenizer:
    """Exact fallback detokenizer: re-decodes all ids each step and emits the new suffix.

    Holds back trailing U+FFFD (it may still become a character) and, when the tokenizer cleans up
    tokenization spaces, text from a space among the last 4 characters (``" ."`` -> ``"."`` etc.). Cost is
    O(n) per step (O(n^2) per request); used only when the decode table cannot express the decoder.
    """

    def __init__(self, decode: Callable[[list[int]], str], holds_cleanup: bool = False) -> None:
        self._decode = decode
        self._holds_cleanup = holds_cleanup
        self._ids: list[int] = []
        self._emitted = ""

    def feed(self, ids: Sequence[int]) -> str:
        """Append token ids; return the newly stable text."""
        self._ids.extend(ids)
        text = self._decode(self._ids)
        end = len(text)
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        if self._holds_cleanup:
            space = text.rfind(" ", max(0, end - _CLEANUP_MAX_HOLD), end)
            if space >= 0:
                end = space
        return self._advance(text, end)

    def flush(self) -> str:
        """End of the request: the rest of the full decode."""
        text = self._decode(self._ids)
        return self._advance(text, len(text))

    def _advance(self, text: str, end: int) -> str:
        done = len(self._emitted)
        if end <= done:
            return ""
        if not text.startswith(self._emitted):
            logger.warning("fallback detokenizer: decoded text changed before the emitted point")
        delta = text[done:end]
        self._emitted += delta
        return delta
