# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled decode table and incremental detokenizer (built as ``proxy.hotpath._detokenizer``): same
names, signatures and results as ``proxy/hotpath/python/detokenizer.py``, which documents the
semantics. Stdlib/CPython API only.

The decode table is one contiguous byte blob with C offsets and a C kind array; the detokenizer
appends token bytes into a C buffer (``ext/byte_buffer.pxd``) and decodes once per ``feed`` with
``PyUnicode_DecodeUTF8`` (``"replace"``: maximal-subpart U+FFFD, as ``bytes.decode`` and Rust
``from_utf8_lossy``), or builds the ``str`` directly when the bytes are well-formed (one-character
results from a small cache; ``ext/utf8_codec.pxd``). A single id fed with nothing pending returns the
token's cached text (filled on first use per table).
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING
from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc
from cpython.ref cimport PyObject, Py_INCREF, Py_XDECREF
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.string cimport memmove

from byte_buffer cimport (
    ByteBuf,
    ByteRun,
    buf_append,
    buf_free,
    buf_init,
    run_end,
    run_feed,
    run_init,
)
from utf8_codec cimport _CHAR_CACHE_SIZE, _complete_prefix_len, _decode_utf8

cdef extern from "Python.h":
    bint PyLong_CheckExact(PyObject* o)
    PyObject** PySequence_Fast_ITEMS(object o)
    Py_ssize_t PySequence_Fast_GET_SIZE(object o)
    Py_ssize_t PyLong_AsSsize_t(PyObject* o) except? -1

cdef unsigned char KIND_TEXT = 0
cdef unsigned char KIND_SKIP = 1
cdef unsigned char KIND_BYTE = 2

cdef str _EMPTY = ""

# One-character strings by code point (see ``_decode_utf8``); owned references, never released.
cdef PyObject* _char_cache[_CHAR_CACHE_SIZE]


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
    cdef ByteBuf _buf  # undecoded bytes: at most an incomplete UTF-8 tail after each feed
    cdef ByteRun _run  # pending byte-fallback run
    cdef bint _strip_pending

    def __cinit__(self):
        self._buf.data = NULL
        self._run.bytes.data = NULL

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
        buf_init(&self._buf, 256)
        run_init(&self._run, 16)
        self._strip_pending = t.strip_leading_space

    def __dealloc__(self):
        buf_free(&self._buf)
        buf_free(&self._run.bytes)

    cdef str _emit(self, Py_ssize_t k):
        cdef Py_ssize_t start = 0
        cdef str text
        if k == 0:
            return _EMPTY
        if self._strip_pending:
            self._strip_pending = False
            if self._buf.data[0] == 0x20:
                start = 1
        text = _decode_utf8(self._buf.data + start, k - start, _char_cache)
        if k < self._buf.len:
            memmove(self._buf.data, self._buf.data + k, self._buf.len - k)
        self._buf.len -= k
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
        if count == 1 and self._buf.len == 0 and PyLong_CheckExact(items[0]):
            # One id and nothing pending (the usual decode step): no buffer round trip. A text token whose
            # bytes are complete UTF-8 returns its cached text, exactly what the general path decodes.
            tid = PyLong_AsSsize_t(items[0])
            if tid < 0 or tid >= self._n:
                return _EMPTY
            kind = self._kinds[tid]
            if kind == KIND_SKIP:
                return _EMPTY
            if kind == KIND_TEXT and self._run.bytes.len == 0 and not self._strip_pending:
                cached = self._table._token_str(tid)
                if cached != <PyObject*>None:
                    self._run.invalid = False  # what ``run_end`` does to an empty run
                    return <object>cached
        for i in range(count):
            tid = PyLong_AsSsize_t(items[i])
            if tid < 0 or tid >= self._n:
                continue
            kind = self._kinds[tid]
            if kind == KIND_TEXT:
                if self._run.bytes.len or self._run.invalid:
                    run_end(&self._run, &self._buf)
                a = self._offsets[tid]
                b = self._offsets[tid + 1]
                buf_append(&self._buf, self._blob + a, b - a)
            elif kind == KIND_BYTE:
                run_feed(&self._run, &self._buf, self._blob[self._offsets[tid]])
        return self._emit(_complete_prefix_len(self._buf.data, self._buf.len))

    def flush(self):
        """End of the request: decode whatever is held back (incomplete bytes become U+FFFD)."""
        run_end(&self._run, &self._buf)
        return self._emit(self._buf.len)
