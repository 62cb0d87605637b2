"""Pure-Python reference of the hot path: decode table, incremental detokenizer, stop checker, SSE framer.

Always importable (stdlib only). ``ext/hotpath.pyx`` is the compiled twin with the same names, signatures
and results; ``proxy.hotpath`` selects one of the two. Tests run both and compare them.

Semantics follow the Hugging Face ``tokenizers`` decoders (ByteLevel, ByteFallback + Fuse + Strip) so that
the joined output of :class:`IncrementalDetokenizer` equals
``tokenizer.decode(ids, skip_special_tokens=True)``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

__all__ = [
    "ChunkFramer",
    "DecodeTable",
    "IncrementalDetokenizer",
    "StopChecker",
    "dumps",
    "utf8_complete_prefix_len",
]

_REPLACEMENT_UTF8 = "\ufffd".encode()


def utf8_complete_prefix_len(buf: bytes | bytearray) -> int:
    """Length of the prefix of ``buf`` whose decoding can no longer change when more bytes follow.

    Only a trailing *incomplete but still valid* UTF-8 sequence (at most 3 bytes: a lead byte and the
    continuation bytes allowed after it, Unicode 15 table 3-7) is held back; everything before it decodes
    the same as in ``bytes.decode("utf-8", "replace")`` of the whole stream (maximal-subpart replacement,
    which is also what Rust's ``String::from_utf8_lossy`` in ``tokenizers`` does).
    """
    n = len(buf)
    j = n - 1
    stop = n - 4 if n >= 4 else -1
    while j > stop and (buf[j] & 0xC0) == 0x80:
        j -= 1
    if j <= stop:
        return n
    lead = buf[j]
    if 0xC2 <= lead <= 0xDF:
        need = 2
    elif 0xE0 <= lead <= 0xEF:
        need = 3
    elif 0xF0 <= lead <= 0xF4:
        need = 4
    else:
        return n
    have = n - j
    if have >= need:
        return n
    if have >= 2:
        lo, hi = _second_byte_range(lead)
        if not lo <= buf[j + 1] <= hi:
            return n
    return j


def _second_byte_range(lead: int) -> tuple[int, int]:
    """Allowed range of the byte after a UTF-8 lead byte (Unicode table 3-7, well-formed sequences)."""
    if lead == 0xE0:
        return 0xA0, 0xBF
    if lead == 0xED:
        return 0x80, 0x9F
    if lead == 0xF0:
        return 0x90, 0xBF
    if lead == 0xF4:
        return 0x80, 0x8F
    return 0x80, 0xBF


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
                self._run_lo, self._run_hi = _second_byte_range(b)
            elif 0xF0 <= b <= 0xF4:
                self._run_need = 3
                self._run_lo, self._run_hi = _second_byte_range(b)
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


class StopChecker:
    """Stop strings on streamed text (OpenAI ``stop``): output ends before the earliest match.

    ``feed(text)`` returns ``(safe_text, index)``: ``safe_text`` may be emitted now, ``index`` is the
    position in ``stop`` of the matched string or -1. Held back is only the longest suffix that is a
    proper prefix of some stop string, or, once a match is found, text that could still begin an
    earlier-starting match of another stop string. The matched stop string is not output; after a
    match every ``feed`` returns ``("", index)``. Empty stop strings are ignored. Works on code points,
    so a character is never split.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._stops = [(i, s) for i, s in enumerate(stop) if s]
        self._max_len = max((len(s) for _, s in self._stops), default=0)
        self._held = ""
        self._matched = -1

    @property
    def matched_index(self) -> int:
        """Index of the matched stop string, or -1 (also set when ``flush`` resolves a match)."""
        return self._matched

    def feed(self, text: str) -> tuple[str, int]:
        """Add newly decoded text; see the class docstring."""
        if self._matched >= 0:
            return "", self._matched
        if not self._stops:
            return text, -1
        held = self._held + text
        pos, index = self._earliest_match(held)
        if pos >= 0:
            q = self._earlier_candidate(held, pos)
            if q >= 0:
                self._held = held[q:]
                return held[:q], -1
            self._matched = index
            self._held = ""
            return held[:pos], index
        keep = self._partial_suffix_len(held)
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep], -1

    def flush(self) -> str:
        """End of the request without a match: release held-back text (cut at a pending match)."""
        if self._matched >= 0:
            return ""
        held, self._held = self._held, ""
        pos, index = self._earliest_match(held)
        if pos >= 0:
            self._matched = index
            return held[:pos]
        return held

    def _earliest_match(self, text: str) -> tuple[int, int]:
        best_pos = -1
        best_end = 0
        best_index = -1
        for i, s in self._stops:
            p = text.find(s)
            if p < 0:
                continue
            end = p + len(s)
            if best_pos < 0 or p < best_pos or (p == best_pos and end < best_end):
                best_pos, best_end, best_index = p, end, i
        return best_pos, best_index

    def _earlier_candidate(self, text: str, pos: int) -> int:
        """Earliest start ``q < pos`` where a stop string could still match (``text[q:]`` is a proper
        prefix of it), or -1."""
        n = len(text)
        for q in range(max(0, n - self._max_len + 1), pos):
            tail = text[q:]
            for _, s in self._stops:
                if len(s) > n - q and s.startswith(tail):
                    return q
        return -1

    def _partial_suffix_len(self, text: str) -> int:
        n = len(text)
        for k in range(min(self._max_len - 1, n), 0, -1):
            tail = text[n - k :]
            for _, s in self._stops:
                if len(s) > k and s.startswith(tail):
                    return k
        return 0


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def dumps(obj: object) -> str:
    """Canonical compact JSON, identical to ``json.dumps(obj, ensure_ascii=False, separators=(",", ":"))``."""
    return _ENCODER.encode(obj)


def _escape(text: str) -> str:
    """JSON string body of ``text`` (without quotes), as ``json.dumps(ensure_ascii=False)`` writes it."""
    return _ENCODER.encode(text)[1:-1]


_DONE = b"data: [DONE]\n\n"


class ChunkFramer:
    """SSE events of one streamed response (OpenAI ``chat.completion.chunk`` or ``text_completion``).

    Every method returns one event, ``b"data: " + compact JSON + b"\\n\\n"``, byte-identical to
    ``json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()`` of the chunk dict in the
    OpenAI API reference (streaming chat completions / legacy completions), keys in that order. With
    ``include_usage`` (``stream_options.include_usage``) every chunk but the usage chunk ends with
    ``"usage":null``, as OpenAI sends. The constant JSON around the text is built once per request.

    Raises:
        ValueError: ``object`` is neither ``"chat.completion.chunk"`` nor ``"text_completion"``.
    """

    def __init__(self, object: str, response_id: str, created: int, model: str, include_usage: bool) -> None:
        if object not in ("chat.completion.chunk", "text_completion"):
            raise ValueError(f"unknown chunk object {object!r}")
        self.is_chat = object == "chat.completion.chunk"
        self._head = (
            "data: {"
            f'"id":{dumps(response_id)},"object":{dumps(object)},"created":{dumps(created)},'
            f'"model":{dumps(model)},'
        )
        self._choice_head = self._head + '"choices":[{"index":'
        self._tail = "}]" + (',"usage":null' if include_usage else "") + "}\n\n"
        if self.is_chat:
            self._content_open = ',"delta":{"content":"'
            self._content_close = '"},"logprobs":'
        else:
            self._content_open = ',"text":"'
            self._content_close = '","logprobs":'

    def role(self, index: int) -> bytes:
        """First chunk of a chat choice: ``delta = {"role":"assistant","content":""}``.

        Text completions have no role chunk: returns ``b""`` (no event) for them.
        """
        if not self.is_chat:
            return b""
        s = (
            f'{self._choice_head}{int(index)},"delta":{{"role":"assistant","content":""}},'
            f'"logprobs":null,"finish_reason":null{self._tail}'
        )
        return s.encode()

    def content(self, index: int, text: str, logprobs_json: str | None = None) -> bytes:
        """A text delta; ``logprobs_json`` (already serialized JSON) replaces ``null`` for ``logprobs``."""
        s = (
            f"{self._choice_head}{int(index)}{self._content_open}{_escape(text)}{self._content_close}"
            f"{'null' if logprobs_json is None else logprobs_json},\"finish_reason\":null{self._tail}"
        )
        return s.encode()

    def finish(self, index: int, finish_reason: str) -> bytes:
        """Last chunk of a choice: empty delta (chat) or ``"text":""``, with ``finish_reason``."""
        body = '"delta":{}' if self.is_chat else '"text":""'
        s = (
            f'{self._choice_head}{int(index)},{body},"logprobs":null,'
            f'"finish_reason":{dumps(finish_reason)}{self._tail}'
        )
        return s.encode()

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> bytes:
        """Usage chunk (``choices: []``), sent before ``[DONE]`` when ``include_usage`` was asked.

        ``usage`` is ``{"prompt_tokens","completion_tokens","total_tokens",
        "prompt_tokens_details":{"cached_tokens"}}`` as in the OpenAI API reference (chat completion
        object); ``cached_tokens`` is the number of prompt tokens served from the prefix cache, 0 when
        none (OpenAI always sends the details object).
        """
        p = int(prompt_tokens)
        c = int(completion_tokens)
        k = int(cached_tokens)
        s = (
            f'{self._head}"choices":[],"usage":{{"prompt_tokens":{p},"completion_tokens":{c},'
            f'"total_tokens":{p + c},"prompt_tokens_details":{{"cached_tokens":{k}}}}}}}\n\n'
        )
        return s.encode()

    def error(self, message: str, type: str, code: str | None) -> bytes:
        """In-band error event ``{"error":{"message","type","param":null,"code"}}`` (the stream
        already started)."""
        error = {"message": message, "type": type, "param": None, "code": code}
        return ("data: " + dumps({"error": error}) + "\n\n").encode()

    def done(self) -> bytes:
        """The terminating ``data: [DONE]`` event."""
        return _DONE
