"""``proxy.heap.freeze_heap``: start-up's garbage collected, what is alive kept out of later passes."""

from __future__ import annotations

import gc
import weakref

from proxy.heap import freeze_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_freeze_collects_the_garbage_then_freezes_what_is_alive() -> None:
    dead_a, dead_b = _Node(), _Node()
    dead_a.other, dead_b.other = dead_b, dead_a  # a cycle only the collector frees
    dead = weakref.ref(dead_a)
    del dead_a, dead_b
    alive = _Node()
    alive.other = alive
    gc.unfreeze()
    try:
        freeze_heap()
        assert dead() is None
        assert gc.get_freeze_count() > 0
        assert gc.get_count()[2] == 0
        before = gc.get_freeze_count()
        gc.collect()  # a full pass now skips the frozen objects: they stay frozen
        assert gc.get_freeze_count() == before
        assert alive.other is alive
    finally:
        gc.unfreeze()
