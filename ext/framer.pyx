# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled SSE framer and canonical JSON (built as ``proxy.hotpath._framer``): same names, signatures
and results as ``proxy/hotpath/python/framer.py``, which documents the semantics (OpenAI stream chunks).
Stdlib/CPython API only.

The framer escapes text straight from its UTF-8 bytes into a preallocated ``bytes`` object.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memcpy

import json

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object o, Py_ssize_t* size) except NULL


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


cdef bytes _escaped(str text):
    """``text`` as the body of a JSON string (UTF-8, without quotes)."""
    cdef Py_ssize_t n
    cdef const unsigned char* s = <const unsigned char*>PyUnicode_AsUTF8AndSize(text, &n)
    cdef Py_ssize_t extra = _escaped_extra(s, n)
    if extra == 0:
        return PyBytes_FromStringAndSize(<const char*>s, n)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n + extra)
    _escape_into(<unsigned char*>PyBytes_AS_STRING(out), s, n)
    return out


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

    def reasoning(self, index, str text):
        """Thinking text: ``delta = {"reasoning_content": text, "reasoning": text}``."""
        cdef bytes escaped = _escaped(text)
        return b"".join((self._choice_head, self._index(index), b',"delta":{"reasoning_content":"', escaped,
                         b'","reasoning":"', escaped, b'"},"logprobs":null', self._null_finish_tail))

    def tool_calls(self, index, str tool_calls_json):
        """``delta = {"tool_calls": <tool_calls_json>}`` (a serialized JSON array)."""
        return b"".join((self._choice_head, self._index(index), b',"delta":{"tool_calls":',
                         tool_calls_json.encode(), b'},"logprobs":null', self._null_finish_tail))

    def finish(self, index, finish_reason):
        """Last chunk of a choice: empty delta (chat) or ``"text":""``, with ``finish_reason``."""
        body = b',"delta":{},"logprobs":null,"finish_reason":' if self.is_chat \
            else b',"text":"","logprobs":null,"finish_reason":'
        return b"".join((self._choice_head, self._index(index), body, dumps(finish_reason).encode(),
                         self._tail))

    def usage(self, prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens=None):
        """Usage chunk (``choices: []``); see ``proxy.hotpath.python.ChunkFramer.usage``."""
        cdef object p = int(prompt_tokens)
        cdef object c = int(completion_tokens)
        cdef object k = int(cached_tokens)
        r = "" if reasoning_tokens is None else \
            f',"completion_tokens_details":{{"reasoning_tokens":{int(reasoning_tokens)}}}'
        return self._head + (f'"choices":[],"usage":{{"prompt_tokens":{p},"completion_tokens":{c},'
                             f'"total_tokens":{p + c},'
                             f'"prompt_tokens_details":{{"cached_tokens":{k}}}{r}}}}}\n\n').encode()

    def error(self, message, type, code):
        """In-band error event ``{"error":{"message","type","param":null,"code"}}``."""
        return ("data: " + dumps({"error": {"message": message, "type": type, "param": None, "code": code}})
                + "\n\n").encode()

    def done(self):
        """The terminating ``data: [DONE]`` event."""
        return _DONE


cdef class EventFramer:
    """See ``proxy.hotpath.python.EventFramer``."""

    cdef public long sequence_number

    def __init__(self):
        self.sequence_number = 0

    def event(self, str type, str fields_json):
        """One event ``{"type", "sequence_number", ...fields}``."""
        cdef long n = self.sequence_number
        self.sequence_number = n + 1
        rest = fields_json[1:-1]
        return (f'event: {type}\ndata: {{"type":{dumps(type)},"sequence_number":{n}'
                f'{"," if rest else ""}{rest}}}\n\n').encode()

    def delta(self, str type, str item_id, output_index, content_index, str text, logprobs_json=None):
        """A text delta event (``content_index`` left out when None, ``logprobs`` when given)."""
        cdef long n = self.sequence_number
        self.sequence_number = n + 1
        head = (f'event: {type}\ndata: {{"type":{dumps(type)},"sequence_number":{n},"item_id":{dumps(item_id)},'
                f'"output_index":{int(output_index)}')
        if content_index is not None:
            head += f',"content_index":{int(content_index)}'
        tail = '"}\n\n' if logprobs_json is None else f'","logprobs":{logprobs_json}}}\n\n'
        return b"".join((head.encode(), b',"delta":"', _escaped(text), tail.encode()))
