"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any

from kvtier.keys import OffloadKey
from kvtier.policies.base import TrackedPolicy

__all__ = ["LRUCachePolicy"]


class LRUCachePolicy(TrackedPolicy):
    """Evicts the least recently used evictable key first.

    :meth:`touch` walks its keys backwards, so the first key of a prefix ends up the
    most recent: under pressure a prefix loses its tail before its head, and a later
    request sharing the head still hits.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Oldest first. Non-evictable keys stay in place so that their recency
        # survives a pin.
        self._entries: OrderedDict[OffloadKey, Any] = OrderedDict()

    def get(self, key: OffloadKey) -> Any | None:
        return self._entries.get(key)

    def insert(self, key: OffloadKey, record: Any) -> None:
        self._entries[key] = record
        self._entries.move_to_end(key)
        self._note_inserted(key)

    def remove(self, key: OffloadKey) -> None:
        self._entries.pop(key, None)
        self._note_removed(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        entries = self._entries
        for key in reversed(keys):
            if key in entries:
                entries.move_to_end(key)

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, Any]] | None:
        if n <= 0:
            return []
        victims: list[tuple[OffloadKey, Any]] = []
        for key, record in self._entries.items():
            if self._is_candidate(key, protected):
                victims.append((key, record))
                if len(victims) == n:
                    break
        else:
            return None
        for key, _ in victims:
            del self._entries[key]
        return victims

    def clear(self) -> None:
        self._entries.clear()
        self._blocked.clear()

    def __len__(self) -> int:
        return len(self._entries)
