# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled UTF-8 boundary rule (built as ``proxy.hotpath._utf8``): same name, signature and results as
``proxy/hotpath/python/utf8.py``, which documents the semantics. The rule itself is the inline
``_complete_prefix_len`` of ``ext/utf8_codec.pxd``, the one the detokenizer compiles in.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE

from utf8_codec cimport _complete_prefix_len


def utf8_complete_prefix_len(buf):
    """See ``proxy.hotpath.python.utf8_complete_prefix_len``."""
    cdef bytes b = bytes(buf)
    return _complete_prefix_len(<const unsigned char*>PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))
