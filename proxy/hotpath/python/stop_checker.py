"""Stop strings (OpenAI ``stop``) on streamed text: emit what is safe, hold back a possible match."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopChecker"]


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
