"""The compiled hot path: the Cython twin of :mod:`proxy.hotpath.python`, one extension module a concept.

``ext/NAME.pyx`` is built into ``proxy.hotpath._NAME`` (``setup.py``): ``_utf8`` (UTF-8 boundaries),
``_detokenizer`` (:class:`DecodeTable`, :class:`IncrementalDetokenizer`), ``_stop_checker``
(:class:`StopChecker`) and ``_framer`` (:class:`ChunkFramer`, :func:`dumps`), each typed by its stub
(``_NAME.pyi``). This module gathers their names, the twin's API, so that the selector
(:mod:`proxy.hotpath`), the tests and the benchmarks take the compiled twin as one module.

Raises:
    ImportError: any of the four is not built or fails to load; the selector then falls back to the
        pure-Python twin as a whole (never a mix) and reports which one (``COMPILED_IMPORT_ERROR``).
"""

from __future__ import annotations

from proxy.hotpath._detokenizer import DecodeTable, IncrementalDetokenizer
from proxy.hotpath._framer import ChunkFramer, EventFramer, dumps
from proxy.hotpath._stop_checker import StopChecker
from proxy.hotpath._utf8 import utf8_complete_prefix_len

__all__ = [
    "ChunkFramer",
    "DecodeTable",
    "EventFramer",
    "IncrementalDetokenizer",
    "StopChecker",
    "dumps",
    "utf8_complete_prefix_len",
]
