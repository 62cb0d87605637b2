"""Pure-Python reference of the hot path: decode table, incremental detokenizer, stop checker, SSE framer.

Always importable (stdlib only). :mod:`proxy.hotpath.compiled` (built from ``ext/*.pyx``, one extension
module a concept) is the compiled twin with the same names, signatures and results; ``proxy.hotpath``
selects one of the two. Tests run both and compare them.

Semantics follow the Hugging Face ``tokenizers`` decoders (ByteLevel, ByteFallback + Fuse + Strip) so that
the joined output of :class:`IncrementalDetokenizer` equals
``tokenizer.decode(ids, skip_special_tokens=True)``.

One concept a module: :mod:`~proxy.hotpath.python.utf8` (UTF-8 boundaries),
:mod:`~proxy.hotpath.python.detokenizer` (:class:`DecodeTable`, :class:`IncrementalDetokenizer`),
:mod:`~proxy.hotpath.python.stop_checker` (:class:`StopChecker`) and
:mod:`~proxy.hotpath.python.framer` (:class:`ChunkFramer`, :func:`dumps`). The names below are the
twin's API (the stubs ``proxy/hotpath/_NAME.pyi``); import them from here.
"""

from __future__ import annotations

from proxy.hotpath.python.detokenizer import DecodeTable, IncrementalDetokenizer
from proxy.hotpath.python.framer import ChunkFramer, EventFramer, dumps
from proxy.hotpath.python.stop_checker import StopChecker
from proxy.hotpath.python.utf8 import utf8_complete_prefix_len

__all__ = [
    "ChunkFramer",
    "DecodeTable",
    "EventFramer",
    "IncrementalDetokenizer",
    "StopChecker",
    "dumps",
    "utf8_complete_prefix_len",
]
