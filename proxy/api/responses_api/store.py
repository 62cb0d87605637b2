"""Stored responses (``store: true``, OpenAI's default), for ``previous_response_id``,
``item_reference`` input items and ``GET`` / ``DELETE /v1/responses/{id}``: in this process's memory,
bounded in count and in bytes, least recently used out. Not durable: a restart forgets every response."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    """One finished response.

    Attributes:
        response: the response object as it was returned.
        conversation: the input items that produced it followed by its output items: the input
            of a request that continues it with ``previous_response_id``.
        num_bytes: the size this entry is counted as (its JSON).
    """

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    num_bytes: int


class ResponseStore:
    """An LRU map ``response id -> StoredResponse`` of at most ``max_entries`` entries and
    ``max_bytes`` bytes of JSON (an entry larger than ``max_bytes`` alone is not stored).

    It also keeps an index ``item id -> {response id -> item}`` of the items (with an ``id``
    string) of every stored conversation, input and output alike, kept exact by :meth:`put`,
    :meth:`delete` and eviction, so that :meth:`item` (an ``item_reference``) is one dict lookup; an
    item stays findable while any stored response holds it.

    Args:
        max_entries: most stored responses (``--responses-store-max-entries``); 0 turns storing off.
        max_bytes: most bytes of stored JSON (``--responses-store-max-bytes``).
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._items: dict[str, dict[str, dict[str, Any]]] = {}
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Store ``response`` (under its ``id``); returns whether it was kept."""
        size = len(json.dumps([response, conversation], ensure_ascii=False).encode("utf-8", "replace"))
        if self.max_entries <= 0 or size > self.max_bytes:
            return False
        self.delete(response["id"])
        self._entries[response["id"]] = StoredResponse(response, conversation, size)
        self.num_bytes += size
        for item in conversation:
            if isinstance(item.get("id"), str):
                self._items.setdefault(item["id"], {})[response["id"]] = item
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            old_id, old = self._entries.popitem(last=False)
            self._forget(old_id, old)
        return True

    def _forget(self, response_id: str, entry: StoredResponse) -> None:
        self.num_bytes -= entry.num_bytes
        for item in entry.conversation:
            item_id = item.get("id")
            if isinstance(item_id, str) and item_id in self._items:
                self._items[item_id].pop(response_id, None)
                if not self._items[item_id]:
                    del self._items[item_id]

    def item(self, item_id: str) -> dict[str, Any] | None:
        """The stored item with this id (from the most recently stored response that holds it; that
        response is now the most recently used), or None when no stored response holds it."""
        holders = self._items.get(item_id)
        if not holders:
            return None
        response_id, found = next(reversed(holders.items()))
        self.get(response_id)  # now the most recently used
        return found

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None when unknown or evicted."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Forget a response; returns whether it was stored."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._forget(response_id, entry)
        return True
