"""``proxy.heap.freeze_heap``: start-up's garbage collected, what is alive kept out of later passes."""

from __future__ import annotations

import gc
import weakref

from proxy.heap import freeze_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _tracked(obj: object) -> bool:
    """Whether ``obj`` sits in one of the collector's generations (``gc.get_objects()`` lists those
    three and never the permanent generation ``gc.freeze()`` fills)."""
    return any(o is obj for o in gc.get_objects())


def test_freeze_collects_the_garbage_then_freezes_what_is_alive() -> None:
    dead_a, dead_b = _Node(), _Node()
    dead_a.other, dead_b.other = dead_b, dead_a  # a cycle only the collector frees
    dead = weakref.ref(dead_a)
    del dead_a, dead_b
    alive = _Node()
    alive.other = alive
    gc.unfreeze()
    try:
        assert _tracked(alive)
        freeze_heap()
        assert dead() is None
        assert gc.get_freeze_count() > 0
        assert not _tracked(alive)
        # A full pass skips the frozen objects: they stay frozen. (The frozen count itself may drop
        # meanwhile: reference counting still frees frozen objects, for example when a finalizer the
        # pass runs, or another test's thread, lets go of the last reference.)
        gc.collect()
        assert not _tracked(alive)
        assert alive.other is alive
        later = _Node()
        assert _tracked(later)  # objects made after the freeze are collected as usual
    finally:
        gc.unfreeze()
    assert _tracked(alive)
