"""Least-recently-used eviction, a prefix at a time."""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from typing import Any

from kvtier.keys import OffloadKey
from kvtier.policies.base import PrefixOrder, TrackedPolicy

__all__ = ["LRUCachePolicy"]


class LRUCachePolicy(TrackedPolicy):
    """Evicts the least recently used prefix first, and each prefix from its tail.

    Keys are ranked by prefix (:class:`~kvtier.policies.base.PrefixOrder`): the keys a
    request stored, promoted or loaded (:meth:`follow`), or that one :meth:`touch`
    named, form one prefix, ranked by its latest use. Under pressure the oldest prefix
    loses its tail first, and a later request sharing its head still hits, however
    many calls stored it.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Non-evictable keys keep their rank, so that it survives a pin.
        self._order = PrefixOrder()

    def get(self, key: OffloadKey) -> Any | None:
        return self._order.get(key)

    def insert(self, key: OffloadKey, record: Any) -> None:
        self._order.insert(key, record)
        self._note_inserted(key)

    def remove(self, key: OffloadKey) -> None:
        self._order.pop(key)
        self._note_removed(key)

    def follow(self, keys: Sequence[OffloadKey], owner: Hashable) -> None:
        order = self._order
        for key in keys:
            if key in order:
                order.use(key, owner)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.follow(keys, object())

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, Any]] | None:
        if n <= 0:
            return []
        victims: list[tuple[OffloadKey, Any]] = []
        for key, record in self._order.oldest():
            if self._is_candidate(key, protected):
                victims.append((key, record))
                if len(victims) == n:
                    break
        else:
            return None
        for key, _ in victims:
            self._order.pop(key)
        return victims

    def clear(self) -> None:
        self._order.clear()
        self._blocked.clear()

    def __len__(self) -> int:
        return len(self._order)
