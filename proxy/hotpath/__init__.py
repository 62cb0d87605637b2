"""Hot path selector: the compiled twin (:mod:`proxy.hotpath.compiled`, which gathers the extension
modules built from ``ext/*.pyx``) unless ``STREAMPROXY_PURE_PYTHON=1`` or any of its modules failed to
import; then the pure-Python reference (``proxy.hotpath.python``), never a mix of the two.
``IS_COMPILED`` says which one is exported; ``COMPILED_IMPORT_ERROR`` holds the import error text (it
names the missing module) when the compiled twin should have loaded and did not (a test fails on it
when ``STREAMPROXY_REQUIRE_COMPILED=1``, as ``make test`` sets).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

COMPILED_IMPORT_ERROR: str | None = None
IS_COMPILED = False

if TYPE_CHECKING:
    # Type checkers see the compiled modules' classes through their stubs (``_NAME.pyi``), so every
    # call site is checked against them (yarl's ``_quoting.py`` does the same with ``TYPE_CHECKING``);
    # the ``python`` twin's signatures are held equal to the stubs' by tests/hotpath/test_hotpath_selector.py.
    from proxy.hotpath.compiled import (
        ChunkFramer,
        DecodeTable,
        EventFramer,
        IncrementalDetokenizer,
        StopChecker,
        dumps,
        utf8_complete_prefix_len,
    )
else:
    from proxy.hotpath import python as _impl

    if os.environ.get("STREAMPROXY_PURE_PYTHON", "") != "1":
        try:
            from proxy.hotpath import compiled
        except ImportError as exc:  # not built: fall back, a test reports it when CI requires it
            COMPILED_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
        else:
            _impl = compiled
            IS_COMPILED = True

    DecodeTable = _impl.DecodeTable
    IncrementalDetokenizer = _impl.IncrementalDetokenizer
    StopChecker = _impl.StopChecker
    ChunkFramer = _impl.ChunkFramer
    EventFramer = _impl.EventFramer
    dumps = _impl.dumps
    utf8_complete_prefix_len = _impl.utf8_complete_prefix_len

__all__ = [
    "COMPILED_IMPORT_ERROR",
    "IS_COMPILED",
    "ChunkFramer",
    "DecodeTable",
    "EventFramer",
    "IncrementalDetokenizer",
    "StopChecker",
    "dumps",
    "utf8_complete_prefix_len",
]
