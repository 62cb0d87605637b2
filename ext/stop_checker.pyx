# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled stop-string checker (built as ``proxy.hotpath._stop_checker``): same name, signature and
results as ``proxy/hotpath/python/stop_checker.py``, which documents the semantics (OpenAI ``stop``).
Stdlib/CPython API only.
"""

cimport cython
from cpython.ref cimport PyObject

cdef extern from "Python.h":
    unsigned int PyUnicode_READ_CHAR(PyObject* o, Py_ssize_t index)
    Py_ssize_t PyUnicode_FindChar(object s, unsigned int ch, Py_ssize_t start, Py_ssize_t end,
                                  int direction) except -2

cdef str _EMPTY = ""


cdef class StopChecker:
    """See ``proxy.hotpath.python.StopChecker``."""

    cdef list _stops
    cdef list _stop_index
    cdef Py_ssize_t _max_len
    cdef str _held
    cdef Py_ssize_t _matched
    cdef str _inner_chars  # characters a partial match can end with: each stop string but its last

    def __init__(self, stop):
        cdef Py_ssize_t i
        self._stops = []
        self._stop_index = []
        for i, s in enumerate(stop):
            if s:
                self._stops.append(str(s))
                self._stop_index.append(i)
        self._max_len = max([len(s) for s in self._stops], default=0)
        self._inner_chars = "".join([s[:len(s) - 1] for s in self._stops])
        self._held = _EMPTY
        self._matched = -1

    @property
    def matched_index(self):
        """Index of the matched stop string, or -1 (also set when ``flush`` resolves a match)."""
        return self._matched

    @cython.binding(False)
    @cython.always_allow_keywords(True)
    def feed(self, str text):
        """Add newly decoded text; returns ``(safe_text, matched_index_or_-1)``."""
        cdef str held
        cdef Py_ssize_t pos, index, q, keep
        if self._matched >= 0:
            return _EMPTY, self._matched
        if not self._stops:
            return text, -1
        held = self._held + text if self._held else text
        pos, index = self._earliest_match(held)
        if pos >= 0:
            q = self._earlier_candidate(held, pos)
            if q >= 0:
                self._held = held[q:]
                return held[:q], -1
            self._matched = index
            self._held = _EMPTY
            return held[:pos], index
        keep = self._partial_suffix_len(held)
        if keep:
            self._held = held[len(held) - keep:]
            return held[:len(held) - keep], -1
        self._held = _EMPTY
        return held, -1

    def flush(self):
        """End of the request without a match: release held-back text (cut at a pending match)."""
        cdef str held
        cdef Py_ssize_t pos, index
        if self._matched >= 0:
            return _EMPTY
        held = self._held
        self._held = _EMPTY
        pos, index = self._earliest_match(held)
        if pos >= 0:
            self._matched = index
            return held[:pos]
        return held

    cdef tuple _earliest_match(self, str text):
        cdef Py_ssize_t best_pos = -1, best_end = 0, best_index = -1, p, end, k
        cdef str s
        for k in range(len(self._stops)):
            s = <str>self._stops[k]
            p = text.find(s)
            if p < 0:
                continue
            end = p + len(s)
            if best_pos < 0 or p < best_pos or (p == best_pos and end < best_end):
                best_pos = p
                best_end = end
                best_index = <Py_ssize_t>self._stop_index[k]
        return best_pos, best_index

    cdef Py_ssize_t _earlier_candidate(self, str text, Py_ssize_t pos):
        cdef Py_ssize_t n = len(text), q, start = n - self._max_len + 1
        cdef str tail, s
        if start < 0:
            start = 0
        for q in range(start, pos):
            tail = text[q:]
            for s in self._stops:
                if len(s) > n - q and s.startswith(tail):
                    return q
        return -1

    cdef Py_ssize_t _partial_suffix_len(self, str text):
        cdef Py_ssize_t n = len(text), k, top = self._max_len - 1
        cdef str tail, s
        if top > n:
            top = n
        # A partial match of length k ends with s[k - 1] of a stop string s longer than k: if the last
        # character occurs in no stop string before its last position, nothing can be held back.
        if top <= 0 or PyUnicode_FindChar(self._inner_chars, PyUnicode_READ_CHAR(<PyObject*>text, n - 1),
                                          0, len(self._inner_chars), 1) < 0:
            return 0
        for k in range(top, 0, -1):
            tail = text[n - k:]
            for s in self._stops:
                if len(s) > k and s.startswith(tail):
                    return k
        return 0
