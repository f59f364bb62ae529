"""Adaptive replacement cache (ARC) eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterator, Sequence
from typing import Any

from kvtier.keys import OffloadKey
from kvtier.policies.base import WRITING, PrefixOrder, TrackedPolicy

__all__ = ["ARCCachePolicy"]


class ARCCachePolicy(TrackedPolicy):
    """Balances recency against frequency, and learns the balance.

    - **T1** holds keys used once, **T2** keys used again after they became readable
      (a touch of a key whose bytes are still being written keeps it in T1: that is
      the same use, not a second one).
    - **B1** / **B2** remember keys recently evicted from T1 / T2 (ghosts, no data).
    - ``target_t1`` is the share of the capacity T1 should have. A key re-used while
      it is a B1 ghost means T1 was too small, so the target grows; a B2 ghost means
      T2 was too small, so it shrinks. Each ghost teaches once and is then dropped.
    - Eviction takes from T1 while T1 holds at least its target, else from T2, falling
      back to the other list when one has no evictable key. Each list ranks its keys
      by prefix (:class:`~kvtier.policies.base.PrefixOrder`), as the LRU policy does:
      its least recent prefix goes first, tail first.

    Ghost lists are each bounded by the capacity.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1 = 0.0
        self._t1 = PrefixOrder()
        self._t2 = PrefixOrder()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> Any | None:
        record = self._t1.get(key)
        return record if record is not None else self._t2.get(key)

    def insert(self, key: OffloadKey, record: Any) -> None:
        self._learn_from_ghost(key)
        self._t1.insert(key, record)
        self._note_inserted(key)

    def remove(self, key: OffloadKey) -> None:
        if self._t1.pop(key) is None:
            self._t2.pop(key)
        self._note_removed(key)

    def follow(self, keys: Sequence[OffloadKey], owner: Hashable) -> None:
        t1, t2 = self._t1, self._t2
        for key in keys:
            if key in t1:
                if self._blocked.get(key) is WRITING:
                    t1.use(key, owner)
                else:
                    t2.insert(key, t1.pop(key), owner)
            elif key in t2:
                t2.use(key, owner)
            else:
                self._learn_from_ghost(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.follow(keys, object())

    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, Any]] | None:
        if n <= 0:
            return []
        t1_candidates = self._candidates(self._t1, protected)
        t2_candidates = self._candidates(self._t2, protected)
        chosen: list[tuple[OffloadKey, Any, bool]] = []
        t1_size = len(self._t1)
        while len(chosen) < n:
            prefer_t1 = t1_size > 0 and t1_size >= self.target_t1
            first, second = (
                (t1_candidates, t2_candidates) if prefer_t1 else (t2_candidates, t1_candidates)
            )
            entry = next(first, None)
            from_t1 = prefer_t1
            if entry is None:
                entry = next(second, None)
                from_t1 = not prefer_t1
                if entry is None:
                    return None
            chosen.append((entry[0], entry[1], from_t1))
            if from_t1:
                t1_size -= 1
        victims: list[tuple[OffloadKey, Any]] = []
        for key, record, from_t1 in chosen:
            if from_t1:
                self._t1.pop(key)
                self._b1[key] = None
            else:
                self._t2.pop(key)
                self._b2[key] = None
            victims.append((key, record))
        for ghosts in (self._b1, self._b2):
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)
        return victims

    def clear(self) -> None:
        for entries in (self._t1, self._t2, self._b1, self._b2):
            entries.clear()
        self._blocked.clear()
        self.target_t1 = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """``(|T1|, |T2|, |B1|, |B2|)``, for tests and diagnostics."""
        return len(self._t1), len(self._t2), len(self._b1), len(self._b2)

    def _candidates(
        self, entries: PrefixOrder, protected: Collection[OffloadKey]
    ) -> Iterator[tuple[OffloadKey, Any]]:
        return ((k, r) for k, r in entries.oldest() if self._is_candidate(k, protected))

    def _learn_from_ghost(self, key: OffloadKey) -> None:
        if key in self._b1:
            step = max(1.0, len(self._b2) / len(self._b1))
            self.target_t1 = min(self.target_t1 + step, float(self.capacity))
            del self._b1[key]
        elif key in self._b2:
            step = max(1.0, len(self._b1) / len(self._b2))
            self.target_t1 = max(self.target_t1 - step, 0.0)
            del self._b2[key]
