# cython: language_level=3
"""Well-formed UTF-8 (Unicode 15, table 3-7), as ``cdef inline`` helpers: a header, not a module.

Each ``ext/*.pyx`` that needs them cimports them (``from utf8_codec cimport ...``) and gets its own
inlined copy, so the extension modules stay independent at run time (no ``__pyx_capi__`` imports
between them) and the loops compile exactly as they did in one module. Used by ``ext/utf8.pyx``
(``utf8_complete_prefix_len``) and ``ext/detokenizer.pyx`` (held-back tails, byte-fallback runs, and
building the delta ``str``). The pure-Python twin of the boundary rule is ``proxy/hotpath/python/utf8.py``.
"""

from cpython.ref cimport PyObject, Py_INCREF, Py_XDECREF
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.string cimport memcpy

cdef extern from "Python.h":
    object PyUnicode_New(Py_ssize_t size, unsigned int maxchar)
    void* PyUnicode_DATA(object o)
    int PyUnicode_KIND(object o)
    unsigned int PyUnicode_READ_CHAR(PyObject* o, Py_ssize_t index)
    int PyUnicode_1BYTE_KIND
    int PyUnicode_2BYTE_KIND


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


cdef inline Py_ssize_t _scan_utf8(const unsigned char* s, Py_ssize_t n, unsigned int* maxchar) noexcept nogil:
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


cdef inline unsigned int _utf8_at(const unsigned char* s, Py_ssize_t n) noexcept nogil:
    """The code point of the single well-formed UTF-8 character ``s[:n]`` (``n`` in 2..4)."""
    if n == 2:
        return ((s[0] & 0x1F) << 6) | (s[1] & 0x3F)
    if n == 3:
        return ((s[0] & 0x0F) << 12) | ((s[1] & 0x3F) << 6) | (s[2] & 0x3F)
    return ((s[0] & 0x07) << 18) | ((s[1] & 0x3F) << 12) | ((s[2] & 0x3F) << 6) | (s[3] & 0x3F)


# Size of a direct-mapped cache of one-character strings (a CJK character or emoji completed by a token
# is the commonest non-ASCII delta); an entry is used only when its character is the one asked for. The
# cache itself (``PyObject* cache[_CHAR_CACHE_SIZE]``, owned references) is module state of the caller.
cdef enum:
    _CHAR_CACHE_SIZE = 4096


cdef inline object _decode_utf8(const unsigned char* s, Py_ssize_t n, PyObject** char_cache):
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
        hit = char_cache[cp & (_CHAR_CACHE_SIZE - 1)]
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
        hit = char_cache[cp & (_CHAR_CACHE_SIZE - 1)]
        Py_INCREF(text)
        char_cache[cp & (_CHAR_CACHE_SIZE - 1)] = <PyObject*>text
        Py_XDECREF(hit)
    return text
