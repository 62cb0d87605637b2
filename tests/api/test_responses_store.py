"""The Responses store's bounds (``proxy.api.responses_api.store``): most entries, most bytes of
JSON, least recently used out, an entry over the byte bound alone not stored, 0 entries: off."""

from __future__ import annotations

import json
from typing import Any

from proxy.api.responses_api.store import ResponseStore


def test_store_lru_bounds_count_and_bytes() -> None:
    def response(i: int, pad: int = 0) -> dict[str, Any]:
        return {"id": f"resp_{i}", "output": [], "pad": "x" * pad}

    size = len(json.dumps([response(0), []]).encode())
    store = ResponseStore(max_entries=3, max_bytes=10 * size)
    for i in range(4):
        assert store.put(response(i), [])
    assert len(store) == 3 and store.get("resp_0") is None and store.num_bytes == 3 * size
    assert store.get("resp_1") is not None  # now the most recent: resp_2 is evicted next
    assert store.put(response(4), [])
    assert (
        store.get("resp_2") is None and [store.get(f"resp_{i}") is not None for i in (1, 3, 4)] == [True] * 3
    )

    by_bytes = ResponseStore(max_entries=100, max_bytes=3 * size)
    for i in range(5):
        by_bytes.put(response(i), [])
    assert len(by_bytes) == 3 and by_bytes.num_bytes == 3 * size and by_bytes.get("resp_1") is None
    big = response(9, pad=3 * size)
    assert by_bytes.put(big, []) is False and by_bytes.get("resp_9") is None and len(by_bytes) == 3
    two = response(8, pad=size)  # two entries' worth: evicts the two least recent
    assert by_bytes.put(two, []) and len(by_bytes) == 2 and by_bytes.get("resp_2") is None
    assert by_bytes.num_bytes == len(json.dumps([two, []]).encode()) + size
    assert by_bytes.delete("resp_8") and not by_bytes.delete("resp_8") and by_bytes.num_bytes == size
    off = ResponseStore(max_entries=0, max_bytes=1 << 20)
    assert off.put(response(1), []) is False and len(off) == 0
