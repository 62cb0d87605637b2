"""The hot path implementations under test: the pure-Python twin and, when built, the compiled one."""

from __future__ import annotations

from types import ModuleType

from proxy.hotpath import python

try:
    from proxy.hotpath import compiled
except ImportError:  # not built; tests/hotpath/test_hotpath_selector.py fails when CI requires it
    compiled = None  # type: ignore[assignment]

IMPLS: list[ModuleType] = [python] + ([compiled] if compiled is not None else [])
IMPL_IDS = [m.__name__.rsplit(".", 1)[-1] for m in IMPLS]
