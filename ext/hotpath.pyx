# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled hot path (built as ``proxy.hotpath._hotpath``): same names, signatures and results as
``proxy/hotpath/python.py``, which documents the semantics. Stdlib/CPython API only.

The decode table is one contiguous byte blob with C offsets and a C kind array; the detokenizer
appends token bytes into a C buffer and decodes once per ``feed`` with ``PyUnicode_DecodeUTF8``
(``"replace"``: maximal-subpart U+FFFD, as ``bytes.decode`` and Rust ``from_utf8_lossy``), or builds the
``str`` directly when the bytes are well-formed (one-character results from a small cache). A single id
fed with nothing pending returns the token's cached text (filled on first use per table). The framer
escapes text straight from its UTF-8 bytes into a preallocated ``bytes`` object.
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.ref cimport PyObject, Py_INCREF, Py_XDECREF
from cpython.unicode cimport PyUnicode_AsUTF8String, PyUnicode_DecodeUTF8
from libc.string cimport memcpy, memmove

import json

cdef extern from "Python.h":
    object PyUnicode_New(Py_ssize_t size, unsigned int maxchar)
    void* PyUnicode_DATA(object o)
    int PyUnicode_KIND(object o)
    unsigned int PyUnicode_READ_CHAR(PyObject* o, Py_ssize_t index)
    Py_ssize_t PyUnicode_FindChar(object s, unsigned int ch, Py_ssize_t start, Py_ssize_t end,
                                  int direction) except -2
    int PyUnicode_1BYTE_KIND
    int PyUnicode_2BYTE_KIND
    bint PyLong_CheckExact(PyObject* o)
    PyObject** PySequence_Fast_ITEMS(object o)
    Py_ssize_t PySequence_Fast_GET_SIZE(object o)
    Py_ssize_t PyLong_AsSsize_t(PyObject* o) except? -1
    const char* PyUnicode_AsUTF8AndSize(object o, Py_ssize_t* size) except NULL

cdef unsigned char KIND_TEXT = 0
cdef unsigned char KIND_SKIP = 1
cdef unsigned char KIND_BYTE = 2

cdef str _EMPTY = ""


cdef inline void _second_range(unsigned char lead, unsigned char* lo, unsigned char* hi) noexcept nogil:
    if lead == 0xE0:
        lo[0] = 0xA0; hi[0] = 0xBF
    elif lead == 0xED:
        lo[0] = 0x80; hi[0] = 0x9F
    elif lead == 0xF0:
        lo[0] = 0x90; hi[0] = 0xBF
    elif lead == 0xF4:
        lo[0] = 0x80; hi[0] = 0x8F
    else:
        lo[0] = 0x80; hi[0] = 0xBF


cdef inline Py_ssize_t _complete_prefix_len(const unsigned char* buf, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t j = n - 1
    cdef Py_ssize_t stop = n - 4 if n >= 4 else -1
    cdef unsigned char lead, lo, hi
    cdef Py_ssize_t need, have
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
        _second_range(lead, &lo, &hi)
        if buf[j + 1] < lo or buf[j + 1] > hi:
            return n
    return j


cdef Py_ssize_t _scan_utf8(const unsigned char* s, Py_ssize_t n, unsigned int* maxchar) noexcept nogil:
    """Number of code points in ``s[:n]`` if it is well-formed UTF-8 (Unicode table 3-7), else -1.
    ``maxchar`` gets the largest code point (0 for ``n == 0``)."""
    cdef Py_ssize_t i = 0, count = 0
    cdef unsigned int m = 0, cp
    cdef unsigned char c, lo, hi
    while i < n:
        c = s[i]
        if c < 0x80:
            if c > m:
                m = c
            i += 1
        elif 0xC2 <= c <= 0xDF:
            if i + 1 >= n or (s[i + 1] & 0xC0) != 0x80:
                return -1
            cp = ((c & 0x1F) << 6) | (s[i + 1] & 0x3F)
            if cp > m:
                m = cp
            i += 2
        elif 0xE0 <= c <= 0xF4:
            _second_range(c, &lo, &hi)
            if c <= 0xEF:
                if i + 2 >= n or s[i + 1] < lo or s[i + 1] > hi or (s[i + 2] & 0xC0) != 0x80:
                    return -1
                cp = ((c & 0x0F) << 12) | ((s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F)
                i += 3
            else:
                if (i + 3 >= n or s[i + 1] < lo or s[i + 1] > hi or (s[i + 2] & 0xC0) != 0x80
                        or (s[i + 3] & 0xC0) != 0x80):
                    return -1
                cp = 0x10000  # any astral code point: only the maximum's range matters here
                i += 4
            if cp > m:
                m = cp
        else:
            return -1
        count += 1
    maxchar[0] = m
    return count


# Direct-mapped cache of one-character strings (a CJK character or emoji completed by a token is the
# commonest non-ASCII delta); an entry is used only when its character is the one asked for.
cdef enum:
    _CHAR_CACHE_SIZE = 4096
cdef PyObject* _char_cache[_CHAR_CACHE_SIZE]


cdef object _decode_utf8(const unsigned char* s, Py_ssize_t n):
    """``s[:n].decode("utf-8", "replace")``: built directly when well-formed, else by CPython's decoder
    (maximal-subpart U+FFFD). Equal strings either way (same code points, canonical representation)."""
    cdef unsigned int maxchar, cp
    cdef Py_ssize_t count = _scan_utf8(s, n, &maxchar), i = 0, j = 0
    cdef object text
    cdef int kind
    cdef void* data
    cdef unsigned char c
    cdef PyObject* hit
    if count < 0:
        return PyUnicode_DecodeUTF8(<const char*>s, n, "replace")
    if maxchar < 0x80:
        text = PyUnicode_New(n, maxchar)
        memcpy(PyUnicode_DATA(text), s, n)
        return text
    if count == 1:
        cp = _utf8_at(s, n)
        hit = _char_cache[cp & (_CHAR_CACHE_SIZE - 1)]
        if hit != NULL and PyUnicode_READ_CHAR(hit, 0) == cp:
            return <object>hit
    text = PyUnicode_New(count, maxchar)
    kind = PyUnicode_KIND(text)
    data = PyUnicode_DATA(text)
    while i < n:
        c = s[i]
        if c < 0x80:
            cp = c
            i += 1
        elif c < 0xE0:
            cp = ((c & 0x1F) << 6) | (s[i + 1] & 0x3F)
            i += 2
        elif c < 0xF0:
            cp = ((c & 0x0F) << 12) | ((s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F)
            i += 3
        else:
            cp = ((c & 0x07) << 18) | ((s[i + 1] & 0x3F) << 12) | ((s[i + 2] & 0x3F) << 6) | (s[i + 3] & 0x3F)
            i += 4
        if kind == PyUnicode_1BYTE_KIND:
            (<unsigned char*>data)[j] = <unsigned char>cp
        elif kind == PyUnicode_2BYTE_KIND:
            (<unsigned short*>data)[j] = <unsigned short>cp
        else:
            (<unsigned int*>data)[j] = cp
        j += 1
    if count == 1:
        hit = _char_cache[cp & (_CHAR_CACHE_SIZE - 1)]
        Py_INCREF(text)
        _char_cache[cp & (_CHAR_CACHE_SIZE - 1)] = <PyObject*>text
        Py_XDECREF(hit)
    return text


cdef inline unsigned int _utf8_at(const unsigned char* s, Py_ssize_t n) noexcept nogil:
    """The code point of the single well-formed UTF-8 character ``s[:n]`` (``n`` in 2..4)."""
    if n == 2:
        return ((s[0] & 0x1F) << 6) | (s[1] & 0x3F)
    if n == 3:
        return ((s[0] & 0x0F) << 12) | ((s[1] & 0x3F) << 6) | (s[2] & 0x3F)
    return ((s[0] & 0x07) << 18) | ((s[1] & 0x3F) << 12) | ((s[2] & 0x3F) << 6) | (s[3] & 0x3F)


def utf8_complete_prefix_len(buf):
    """See ``proxy.hotpath.python.utf8_complete_prefix_len``."""
    cdef bytes b = bytes(buf)
    return _complete_prefix_len(<const unsigned char*>PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))


cdef class DecodeTable:
    """See ``proxy.hotpath.python.DecodeTable``."""

    cdef readonly list token_bytes
    cdef readonly frozenset special_ids
    cdef readonly bint strip_leading_space
    cdef readonly frozenset byte_fallback_ids
    cdef bytes _blob
    cdef Py_ssize_t* _offsets
    cdef unsigned char* _kinds
    cdef Py_ssize_t _n
    # Lazily filled per-token decode cache: NULL = not looked at yet, ``None`` = the token's bytes end in an
    # incomplete UTF-8 sequence (must go through the buffer), else ``bytes.decode("utf-8", "replace")`` of
    # the token's bytes: what ``feed([id])`` returns when nothing is pending (owned references).
    cdef PyObject** _strs

    def __cinit__(self):
        self._offsets = NULL
        self._kinds = NULL
        self._strs = NULL

    def __init__(self, list token_bytes, special_ids, bint strip_leading_space,
                 byte_fallback_ids=frozenset()):
        cdef Py_ssize_t i, n = len(token_bytes)
        cdef Py_ssize_t pos = 0
        self.token_bytes = [bytes(b) for b in token_bytes]
        self.special_ids = frozenset(special_ids)
        self.strip_leading_space = strip_leading_space
        self.byte_fallback_ids = frozenset(byte_fallback_ids)
        for i in self.byte_fallback_ids:
            if not 0 <= i < n or len(self.token_bytes[i]) != 1:
                raise ValueError(f"byte-fallback id {i} must map to exactly one byte")
        self._n = n
        self._blob = b"".join(self.token_bytes)
        self._offsets = <Py_ssize_t*>PyMem_Malloc((n + 1) * sizeof(Py_ssize_t))
        self._kinds = <unsigned char*>PyMem_Malloc(n + 1)
        self._strs = <PyObject**>PyMem_Calloc(n + 1, sizeof(PyObject*))
        if self._offsets == NULL or self._kinds == NULL or self._strs == NULL:
            raise MemoryError()
        for i in range(n):
            self._offsets[i] = pos
            pos += len(<bytes>self.token_bytes[i])
            self._kinds[i] = KIND_TEXT
        self._offsets[n] = pos
        for i in self.special_ids:
            if 0 <= i < n:
                self._kinds[i] = KIND_SKIP
        for i in self.byte_fallback_ids:
            if self._kinds[i] == KIND_TEXT:
                self._kinds[i] = KIND_BYTE

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self._strs != NULL:
            for i in range(self._n):
                Py_XDECREF(self._strs[i])
            PyMem_Free(self._strs)
        PyMem_Free(self._offsets)
        PyMem_Free(self._kinds)

    cdef PyObject* _token_str(self, Py_ssize_t tid) except NULL:
        """Borrowed: the cached text of text token ``tid`` alone, or ``None`` (see ``_strs``)."""
        cdef PyObject* r = self._strs[tid]
        cdef Py_ssize_t a, k
        cdef const unsigned char* p
        cdef object text
        if r != NULL:
            return r
        a = self._offsets[tid]
        k = self._offsets[tid + 1] - a
        p = <const unsigned char*>PyBytes_AS_STRING(self._blob) + a
        if _complete_prefix_len(p, k) == k:
            text = PyUnicode_DecodeUTF8(<const char*>p, k, "replace")
        else:
            text = None
        Py_INCREF(text)
        self._strs[tid] = <PyObject*>text
        return <PyObject*>text

    def __len__(self):
        return self._n

    def decode(self, ids):
        """Whole-sequence decode with the table (reference for the incremental path)."""
        cdef IncrementalDetokenizer d = IncrementalDetokenizer(self)
        return d.feed(list(ids)) + d.flush()


cdef class IncrementalDetokenizer:
    """See ``proxy.hotpath.python.IncrementalDetokenizer``."""

    cdef DecodeTable _table
    cdef const unsigned char* _blob
    cdef Py_ssize_t* _offsets
    cdef unsigned char* _kinds
    cdef Py_ssize_t _n
    cdef unsigned char* _buf
    cdef Py_ssize_t _len
    cdef Py_ssize_t _cap
    cdef unsigned char* _run
    cdef Py_ssize_t _run_len
    cdef Py_ssize_t _run_cap
    cdef int _run_need
    cdef unsigned char _run_lo
    cdef unsigned char _run_hi
    cdef bint _run_invalid
    cdef bint _strip_pending

    def __cinit__(self):
        self._buf = NULL
        self._run = NULL

    def __init__(self, table):
        cdef DecodeTable t
        if isinstance(table, DecodeTable):
            t = <DecodeTable>table
        else:  # e.g. the pure-Python twin's table
            t = DecodeTable(list(table.token_bytes), table.special_ids, table.strip_leading_space,
                            getattr(table, "byte_fallback_ids", frozenset()))
        self._table = t
        self._blob = <const unsigned char*>PyBytes_AS_STRING(t._blob)
        self._offsets = t._offsets
        self._kinds = t._kinds
        self._n = t._n
        self._cap = 256
        self._buf = <unsigned char*>PyMem_Malloc(self._cap)
        self._run_cap = 16
        self._run = <unsigned char*>PyMem_Malloc(self._run_cap)
        if self._buf == NULL or self._run == NULL:
            raise MemoryError()
        self._len = 0
        self._run_len = 0
        self._run_need = 0
        self._run_lo = 0x80
        self._run_hi = 0xBF
        self._run_invalid = False
        self._strip_pending = t.strip_leading_space

    def __dealloc__(self):
        PyMem_Free(self._buf)
        PyMem_Free(self._run)

    cdef int _reserve(self, Py_ssize_t extra) except -1:
        cdef Py_ssize_t need = self._len + extra
        cdef Py_ssize_t cap = self._cap
        cdef unsigned char* p
        if need <= cap:
            return 0
        while cap < need:
            cap *= 2
        p = <unsigned char*>PyMem_Realloc(self._buf, cap)
        if p == NULL:
            raise MemoryError()
        self._buf = p
        self._cap = cap
        return 0

    cdef int _append(self, const unsigned char* src, Py_ssize_t k) except -1:
        if self._len + k > self._cap:
            self._reserve(k)
        memcpy(self._buf + self._len, src, k)
        self._len += k
        return 0

    cdef int _append_fffd(self, Py_ssize_t count) except -1:
        cdef Py_ssize_t i
        self._reserve(3 * count)
        for i in range(count):
            self._buf[self._len] = 0xEF
            self._buf[self._len + 1] = 0xBF
            self._buf[self._len + 2] = 0xBD
            self._len += 3
        return 0

    cdef int _end_run(self) except -1:
        if self._run_len:
            if self._run_need == 0:
                self._append(self._run, self._run_len)
            else:
                self._append_fffd(self._run_len)
            self._run_len = 0
        self._run_need = 0
        self._run_invalid = False
        return 0

    cdef int _feed_run_byte(self, unsigned char b) except -1:
        cdef bint ok = True
        cdef unsigned char* p
        if self._run_invalid:
            return self._append_fffd(1)
        if self._run_need == 0:
            if b < 0x80:
                pass
            elif 0xC2 <= b <= 0xDF:
                self._run_need = 1
                self._run_lo = 0x80
                self._run_hi = 0xBF
            elif 0xE0 <= b <= 0xEF:
                self._run_need = 2
                _second_range(b, &self._run_lo, &self._run_hi)
            elif 0xF0 <= b <= 0xF4:
                self._run_need = 3
                _second_range(b, &self._run_lo, &self._run_hi)
            else:
                ok = False
        elif self._run_lo <= b <= self._run_hi:
            self._run_need -= 1
            self._run_lo = 0x80
            self._run_hi = 0xBF
        else:
            ok = False
        if self._run_len == self._run_cap:
            p = <unsigned char*>PyMem_Realloc(self._run, self._run_cap * 2)
            if p == NULL:
                raise MemoryError()
            self._run = p
            self._run_cap *= 2
        self._run[self._run_len] = b
        self._run_len += 1
        if not ok:
            self._append_fffd(self._run_len)
            self._run_len = 0
            self._run_invalid = True
            self._run_need = 0
        return 0

    cdef str _emit(self, Py_ssize_t k):
        cdef Py_ssize_t start = 0
        cdef str text
        if k == 0:
            return _EMPTY
        if self._strip_pending:
            self._strip_pending = False
            if self._buf[0] == 0x20:
                start = 1
        text = _decode_utf8(self._buf + start, k - start)
        if k < self._len:
            memmove(self._buf, self._buf + k, self._len - k)
        self._len -= k
        return text

    @cython.binding(False)
    @cython.always_allow_keywords(True)
    def feed(self, ids):
        """Append token ids; return the newly completed text (possibly ``""``)."""
        cdef PyObject** items
        cdef Py_ssize_t count, i, tid, a, b
        cdef unsigned char kind
        cdef PyObject* cached
        if type(ids) is not list and type(ids) is not tuple:
            ids = list(ids)
        items = PySequence_Fast_ITEMS(ids)
        count = PySequence_Fast_GET_SIZE(ids)
        if count == 1 and self._len == 0 and PyLong_CheckExact(items[0]):
            # One id and nothing pending (the usual decode step): no buffer round trip. A text token whose
            # bytes are complete UTF-8 returns its cached text, exactly what the general path decodes.
            tid = PyLong_AsSsize_t(items[0])
            if tid < 0 or tid >= self._n:
                return _EMPTY
            kind = self._kinds[tid]
            if kind == KIND_SKIP:
                return _EMPTY
            if kind == KIND_TEXT and self._run_len == 0 and not self._strip_pending:
                cached = self._table._token_str(tid)
                if cached != <PyObject*>None:
                    self._run_invalid = False  # what ``_end_run`` does to an empty run
                    return <object>cached
        for i in range(count):
            tid = PyLong_AsSsize_t(items[i])
            if tid < 0 or tid >= self._n:
                continue
            kind = self._kinds[tid]
            if kind == KIND_TEXT:
                if self._run_len or self._run_invalid:
                    self._end_run()
                a = self._offsets[tid]
                b = self._offsets[tid + 1]
                if self._len + (b - a) > self._cap:
                    self._reserve(b - a)
                memcpy(self._buf + self._len, self._blob + a, b - a)
                self._len += b - a
            elif kind == KIND_BYTE:
                self._feed_run_byte(self._blob[self._offsets[tid]])
        return self._emit(_complete_prefix_len(self._buf, self._len))

    def flush(self):
        """End of the request: decode whatever is held back (incomplete bytes become U+FFFD)."""
        self._end_run()
        return self._emit(self._len)


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


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
cdef object _encode = _ENCODER.encode


def dumps(obj):
    """Canonical compact JSON, identical to ``json.dumps(obj, ensure_ascii=False, separators=(",", ":"))``."""
    return _encode(obj)


cdef const char* _HEX = b"0123456789abcdef"
cdef bytes _DONE = b"data: [DONE]\n\n"


cdef inline Py_ssize_t _escaped_extra(const unsigned char* s, Py_ssize_t n) noexcept nogil:
    """Extra bytes JSON escaping adds (``json.dumps(ensure_ascii=False)`` rules)."""
    cdef Py_ssize_t i, extra = 0
    cdef unsigned char c
    for i in range(n):
        c = s[i]
        if c < 0x20:
            if c == 0x08 or c == 0x09 or c == 0x0A or c == 0x0C or c == 0x0D:
                extra += 1
            else:
                extra += 5
        elif c == 0x22 or c == 0x5C:
            extra += 1
    return extra


cdef inline Py_ssize_t _escape_into(unsigned char* out, const unsigned char* s, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i, o = 0
    cdef unsigned char c
    for i in range(n):
        c = s[i]
        if c >= 0x20 and c != 0x22 and c != 0x5C:
            out[o] = c
            o += 1
            continue
        out[o] = 0x5C
        if c == 0x22 or c == 0x5C:
            out[o + 1] = c
            o += 2
        elif c == 0x0A:
            out[o + 1] = 0x6E
            o += 2
        elif c == 0x0D:
            out[o + 1] = 0x72
            o += 2
        elif c == 0x09:
            out[o + 1] = 0x74
            o += 2
        elif c == 0x08:
            out[o + 1] = 0x62
            o += 2
        elif c == 0x0C:
            out[o + 1] = 0x66
            o += 2
        else:
            out[o + 1] = 0x75
            out[o + 2] = 0x30
            out[o + 3] = 0x30
            out[o + 4] = _HEX[c >> 4]
            out[o + 5] = _HEX[c & 15]
            o += 6
    return o


cdef class ChunkFramer:
    """See ``proxy.hotpath.python.ChunkFramer``."""

    cdef readonly bint is_chat
    cdef bytes _head
    cdef bytes _choice_head
    cdef bytes _tail
    cdef bytes _content_open
    cdef bytes _content_close
    cdef bytes _null_finish_tail
    cdef list _index_cache

    def __init__(self, str object, response_id, created, model, include_usage):
        if object not in ("chat.completion.chunk", "text_completion"):
            raise ValueError(f"unknown chunk object {object!r}")
        self.is_chat = object == "chat.completion.chunk"
        head = ('data: {' f'"id":{dumps(response_id)},"object":{dumps(object)},"created":{dumps(created)},'
                f'"model":{dumps(model)},')
        self._head = head.encode()
        self._choice_head = (head + '"choices":[{"index":').encode()
        self._tail = ("}]" + (',"usage":null' if include_usage else "") + "}\n\n").encode()
        if self.is_chat:
            self._content_open = b',"delta":{"content":"'
            self._content_close = b'"},"logprobs":'
        else:
            self._content_open = b',"text":"'
            self._content_close = b'","logprobs":'
        self._null_finish_tail = b',"finish_reason":null' + self._tail
        self._index_cache = [str(i).encode() for i in range(16)]

    cdef bytes _index(self, index):
        cdef Py_ssize_t i = index
        if 0 <= i < 16:
            return <bytes>self._index_cache[i]
        return str(i).encode()

    def role(self, index):
        """First chunk of a chat choice (``delta = {"role":"assistant","content":""}``); ``b""`` for text."""
        if not self.is_chat:
            return b""
        return b"".join((self._choice_head, self._index(index),
                         b',"delta":{"role":"assistant","content":""},"logprobs":null',
                         self._null_finish_tail))

    def content(self, index, str text, logprobs_json=None):
        """A text delta; ``logprobs_json`` (serialized JSON) replaces ``null`` for ``logprobs``."""
        cdef Py_ssize_t n, lp_n
        cdef const unsigned char* s = <const unsigned char*>PyUnicode_AsUTF8AndSize(text, &n)
        cdef const char* lp
        cdef bytes idx = self._index(index)
        cdef Py_ssize_t extra = _escaped_extra(s, n)
        cdef Py_ssize_t total, o = 0
        cdef bytes out
        cdef unsigned char* p
        if logprobs_json is None:
            lp = b"null"
            lp_n = 4
        else:
            lp = PyUnicode_AsUTF8AndSize(logprobs_json, &lp_n)
        cdef Py_ssize_t a = PyBytes_GET_SIZE(self._choice_head)
        cdef Py_ssize_t b = PyBytes_GET_SIZE(idx)
        cdef Py_ssize_t c = PyBytes_GET_SIZE(self._content_open)
        cdef Py_ssize_t d = PyBytes_GET_SIZE(self._content_close)
        cdef Py_ssize_t e = PyBytes_GET_SIZE(self._null_finish_tail)
        total = a + b + c + n + extra + d + lp_n + e
        out = PyBytes_FromStringAndSize(NULL, total)
        p = <unsigned char*>PyBytes_AS_STRING(out)
        memcpy(p, PyBytes_AS_STRING(self._choice_head), a)
        o = a
        memcpy(p + o, PyBytes_AS_STRING(idx), b)
        o += b
        memcpy(p + o, PyBytes_AS_STRING(self._content_open), c)
        o += c
        if extra == 0:
            memcpy(p + o, s, n)
            o += n
        else:
            o += _escape_into(p + o, s, n)
        memcpy(p + o, PyBytes_AS_STRING(self._content_close), d)
        o += d
        memcpy(p + o, lp, lp_n)
        o += lp_n
        memcpy(p + o, PyBytes_AS_STRING(self._null_finish_tail), e)
        return out

    def finish(self, index, finish_reason):
        """Last chunk of a choice: empty delta (chat) or ``"text":""``, with ``finish_reason``."""
        body = b',"delta":{},"logprobs":null,"finish_reason":' if self.is_chat \
            else b',"text":"","logprobs":null,"finish_reason":'
        return b"".join((self._choice_head, self._index(index), body, dumps(finish_reason).encode(),
                         self._tail))

    def usage(self, prompt_tokens, completion_tokens, cached_tokens):
        """Usage chunk (``choices: []``); see ``proxy.hotpath.python.ChunkFramer.usage``."""
        cdef object p = int(prompt_tokens)
        cdef object c = int(completion_tokens)
        cdef object k = int(cached_tokens)
        return self._head + (f'"choices":[],"usage":{{"prompt_tokens":{p},"completion_tokens":{c},'
                             f'"total_tokens":{p + c},'
                             f'"prompt_tokens_details":{{"cached_tokens":{k}}}}}}}\n\n').encode()

    def error(self, message, type, code):
        """In-band error event ``{"error":{"message","type","param":null,"code"}}``."""
        return ("data: " + dumps({"error": {"message": message, "type": type, "param": None, "code": code}})
                + "\n\n").encode()

    def done(self):
        """The terminating ``data: [DONE]`` event."""
        return _DONE
