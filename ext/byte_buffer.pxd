# cython: language_level=3
"""The incremental detokenizer's C byte buffers, as ``cdef inline`` helpers: a header, not a module.

``ByteBuf`` is a growable byte buffer (``PyMem``, capacity doubled as needed): the detokenizer's
undecoded bytes. ``ByteRun`` is a pending run of SentencePiece byte-fallback tokens (``<0xNN>``), which
the Hugging Face ``tokenizers`` ByteFallback decoder turns into text all-or-nothing: a run that is
valid UTF-8 is its text, otherwise every byte of it becomes U+FFFD (the pure-Python twin is
``IncrementalDetokenizer._feed_run_byte`` / ``_end_run`` in ``proxy/hotpath/python/detokenizer.py``).
A byte that makes the run invalid flushes it as U+FFFD at once, and every later byte of the same run
too. cimported by ``ext/detokenizer.pyx`` (see ``ext/utf8_codec.pxd`` for why headers, not modules).

Every function that allocates raises ``MemoryError`` (``except -1``); a zeroed struct (as a ``cdef
class`` field starts) is empty and safe to free.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.string cimport memcpy

from utf8_codec cimport _second_range


cdef struct ByteBuf:
    unsigned char* data
    Py_ssize_t len  # bytes used
    Py_ssize_t cap  # bytes allocated


cdef struct ByteRun:
    ByteBuf bytes  # the run so far (valid UTF-8 so far)
    int need  # continuation bytes still needed by the run's last character
    unsigned char lo  # allowed range of the next continuation byte (Unicode table 3-7)
    unsigned char hi
    bint invalid  # the current run is already known invalid (emitted as U+FFFD per byte)


cdef inline int buf_init(ByteBuf* b, Py_ssize_t cap) except -1:
    b.data = <unsigned char*>PyMem_Malloc(cap)
    if b.data == NULL:
        raise MemoryError()
    b.len = 0
    b.cap = cap
    return 0


cdef inline void buf_free(ByteBuf* b) noexcept:
    PyMem_Free(b.data)
    b.data = NULL
    b.len = 0
    b.cap = 0


cdef inline int buf_reserve(ByteBuf* b, Py_ssize_t extra) except -1:
    cdef Py_ssize_t need = b.len + extra
    cdef Py_ssize_t cap = b.cap
    cdef unsigned char* p
    if need <= cap:
        return 0
    while cap < need:
        cap *= 2
    p = <unsigned char*>PyMem_Realloc(b.data, cap)
    if p == NULL:
        raise MemoryError()
    b.data = p
    b.cap = cap
    return 0


cdef inline int buf_append(ByteBuf* b, const unsigned char* src, Py_ssize_t k) except -1:
    if b.len + k > b.cap:
        buf_reserve(b, k)
    memcpy(b.data + b.len, src, k)
    b.len += k
    return 0


cdef inline int buf_append_fffd(ByteBuf* b, Py_ssize_t count) except -1:
    """Append ``count`` U+FFFD (``EF BF BD``)."""
    cdef Py_ssize_t i
    buf_reserve(b, 3 * count)
    for i in range(count):
        b.data[b.len] = 0xEF
        b.data[b.len + 1] = 0xBF
        b.data[b.len + 2] = 0xBD
        b.len += 3
    return 0


cdef inline int run_init(ByteRun* r, Py_ssize_t cap) except -1:
    buf_init(&r.bytes, cap)
    r.need = 0
    r.lo = 0x80
    r.hi = 0xBF
    r.invalid = False
    return 0


cdef inline int run_end(ByteRun* r, ByteBuf* out) except -1:
    """The run ends (a text token or the end of the request): its text, or U+FFFD per byte, to ``out``."""
    if r.bytes.len:
        if r.need == 0:
            buf_append(out, r.bytes.data, r.bytes.len)
        else:
            buf_append_fffd(out, r.bytes.len)
        r.bytes.len = 0
    r.need = 0
    r.invalid = False
    return 0


cdef inline int run_feed(ByteRun* r, ByteBuf* out, unsigned char b) except -1:
    """One byte-fallback byte: held in the run while the run is valid UTF-8 so far, else U+FFFD to ``out``."""
    cdef bint ok = True
    if r.invalid:
        return buf_append_fffd(out, 1)
    if r.need == 0:
        if b < 0x80:
            pass
        elif 0xC2 <= b <= 0xDF:
            r.need = 1
            r.lo = 0x80
            r.hi = 0xBF
        elif 0xE0 <= b <= 0xEF:
            r.need = 2
            _second_range(b, &r.lo, &r.hi)
        elif 0xF0 <= b <= 0xF4:
            r.need = 3
            _second_range(b, &r.lo, &r.hi)
        else:
            ok = False
    elif r.lo <= b <= r.hi:
        r.need -= 1
        r.lo = 0x80
        r.hi = 0xBF
    else:
        ok = False
    buf_append(&r.bytes, &b, 1)
    if not ok:
        buf_append_fffd(out, r.bytes.len)
        r.bytes.len = 0
        r.invalid = True
        r.need = 0
    return 0
