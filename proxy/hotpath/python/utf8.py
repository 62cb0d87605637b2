"""UTF-8 boundaries of a byte stream: how much of it decodes the same whatever bytes follow.

Shared by the incremental detokenizer (:mod:`proxy.hotpath.python.detokenizer`), which holds back
only an incomplete but still valid trailing sequence. Rules from Unicode 15, table 3-7.
"""

from __future__ import annotations

__all__ = ["second_byte_range", "utf8_complete_prefix_len"]


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
        lo, hi = second_byte_range(lead)
        if not lo <= buf[j + 1] <= hi:
            return n
    return j


def second_byte_range(lead: int) -> tuple[int, int]:
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
