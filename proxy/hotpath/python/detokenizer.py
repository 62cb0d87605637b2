"""Token ids -> text, streamed: the per-tokenizer decode table and the incremental detokenizer.

Semantics follow the Hugging Face ``tokenizers`` decoders (ByteLevel, ByteFallback + Fuse + Strip), so
the joined output of :class:`IncrementalDetokenizer` equals
``tokenizer.decode(ids, skip_special_tokens=True)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from proxy.hotpath.python.utf8 import second_byte_range, utf8_complete_prefix_len

__all__ = ["DecodeTable", "IncrementalDetokenizer"]

_REPLACEMENT_UTF8 = "\ufffd".encode()


class DecodeTable:
    """Per-tokenizer decode table: the exact bytes each token id contributes to decoded text.

    Args:
        token_bytes: ``token_bytes[id]`` = bytes of token ``id`` (byte-level BPE: the byte-to-unicode map
            reversed; SentencePiece: ``▁`` -> space, ``<0xNN>`` -> the byte NN). Ids outside the list decode
            to nothing, as ``tokenizers`` skips unknown ids.
        special_ids: ids that ``decode(..., skip_special_tokens=True)`` drops.
        strip_leading_space: drop one space at the very start of the output (SentencePiece ``Strip``
            decoder, ``start=1``), also when it comes from a byte token or after skipped special tokens.
        byte_fallback_ids: ids of SentencePiece ``<0xNN>`` tokens (each ``token_bytes`` entry one byte). A
            maximal run of them decodes all-or-nothing, as the ``tokenizers`` ByteFallback decoder does:
            valid UTF-8 -> its text, otherwise one U+FFFD per byte token. Extension of the contract
            (keyword, empty by default).

    Raises:
        ValueError: a byte-fallback id whose entry is not exactly one byte.
    """

    def __init__(
        self,
        token_bytes: list[bytes],
        special_ids: frozenset[int],
        strip_leading_space: bool,
        byte_fallback_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.token_bytes = [bytes(b) for b in token_bytes]
        self.special_ids = frozenset(special_ids)
        self.strip_leading_space = bool(strip_leading_space)
        self.byte_fallback_ids = frozenset(byte_fallback_ids)
        for i in self.byte_fallback_ids:
            if not 0 <= i < len(self.token_bytes) or len(self.token_bytes[i]) != 1:
                raise ValueError(f"byte-fallback id {i} must map to exactly one byte")
        # kind: 0 = text bytes, 1 = skipped (special or unknown), 2 = byte-fallback byte
        kinds = bytearray(len(self.token_bytes))
        for i in self.special_ids:
            if 0 <= i < len(kinds):
                kinds[i] = 1
        for i in self.byte_fallback_ids:
            if kinds[i] == 0:
                kinds[i] = 2
        self._kinds = bytes(kinds)

    def __len__(self) -> int:
        return len(self.token_bytes)

    def decode(self, ids: Iterable[int]) -> str:
        """Whole-sequence decode with the table (reference for the incremental path)."""
        detok = IncrementalDetokenizer(self)
        return detok.feed(list(ids)) + detok.flush()


class IncrementalDetokenizer:
    """Streams text for one request: feed new token ids, get back only complete characters.

    Invariant (tested per tokenizer): ``"".join(feed(...) for each step) + flush()`` ==
    ``tokenizer.decode(all_ids, skip_special_tokens=True)``, U+FFFD included where that decode has it.
    At most 3 bytes of an incomplete UTF-8 character are held back (plus, for SentencePiece, a run of
    byte-fallback tokens that is still valid UTF-8 so far, because the ByteFallback decoder turns the
    whole run into U+FFFD if it ends invalid). A byte that can never become valid UTF-8 is emitted as
    U+FFFD at once. Same approach as vLLM/TGI's incremental detokenization, but on bytes, not re-decoding.
    """

    def __init__(self, table: DecodeTable) -> None:
        self._token_bytes = table.token_bytes
        self._kinds = table._kinds
        self._num_tokens = len(table.token_bytes)
        self._buf = bytearray()  # undecoded bytes: at most an incomplete UTF-8 tail after each feed
        self._run = bytearray()  # pending byte-fallback run (valid UTF-8 so far)
        self._run_need = 0  # continuation bytes still needed by the run's last character
        self._run_lo = 0x80
        self._run_hi = 0xBF
        self._run_invalid = False  # current run already known invalid (emitted as U+FFFD per byte)
        self._strip_pending = table.strip_leading_space

    def feed(self, ids: Sequence[int]) -> str:
        """Append token ids; return the newly completed text (possibly ``""``)."""
        token_bytes = self._token_bytes
        kinds = self._kinds
        n = self._num_tokens
        buf = self._buf
        for tid in ids:
            if tid < 0 or tid >= n:
                continue
            kind = kinds[tid]
            if kind == 0:
                if self._run or self._run_invalid:
                    self._end_run()
                buf += token_bytes[tid]
            elif kind == 2:
                self._feed_run_byte(token_bytes[tid][0])
        return self._emit(utf8_complete_prefix_len(buf))

    def flush(self) -> str:
        """End of the request: decode whatever is held back (incomplete bytes become U+FFFD)."""
        self._end_run()
        return self._emit(len(self._buf))

    def _feed_run_byte(self, b: int) -> None:
        if self._run_invalid:
            self._buf += _REPLACEMENT_UTF8
            return
        need = self._run_need
        ok = True
        if need == 0:
            if b < 0x80:
                pass
            elif 0xC2 <= b <= 0xDF:
                self._run_need, self._run_lo, self._run_hi = 1, 0x80, 0xBF
            elif 0xE0 <= b <= 0xEF:
                self._run_need = 2
                self._run_lo, self._run_hi = second_byte_range(b)
            elif 0xF0 <= b <= 0xF4:
                self._run_need = 3
                self._run_lo, self._run_hi = second_byte_range(b)
            else:
                ok = False
        elif self._run_lo <= b <= self._run_hi:
            self._run_need = need - 1
            self._run_lo, self._run_hi = 0x80, 0xBF
        else:
            ok = False
        self._run.append(b)
        if not ok:
            self._buf += _REPLACEMENT_UTF8 * len(self._run)
            self._run.clear()
            self._run_invalid = True
            self._run_need = 0

    def _end_run(self) -> None:
        if self._run:
            if self._run_need == 0:
                self._buf += self._run
            else:
                self._buf += _REPLACEMENT_UTF8 * len(self._run)
            self._run.clear()
        self._run_need = 0
        self._run_invalid = False

    def _emit(self, k: int) -> str:
        if k == 0:
            return ""
        buf = self._buf
        start = 0
        if self._strip_pending:
            self._strip_pending = False
            if buf[0] == 0x20:
                start = 1
        text = buf[start:k].decode("utf-8", "replace")
        del buf[:k]
        return text

