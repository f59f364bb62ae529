"""The eviction-policy interface of the primary tier."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from typing import Any

from kvtier.keys import OffloadKey

__all__ = ["CachePolicy", "TrackedPolicy"]


class CachePolicy(ABC):
    """Decides which primary-tier chunks to evict.

    A policy orders the keys of the primary tier; the primary tier owns slots and ref
    counts and hands the policy an opaque *record* per key, which the policy returns
    from :meth:`get` and :meth:`evict` unchanged.

    Evictability reaches the policy through two notifications. A key is *not*
    evictable from :meth:`insert` (its bytes are still being written) until
    :meth:`mark_evictable` (its ref count became 0: readable and unpinned), and again
    from :meth:`mark_non_evictable` (a reader pinned it) until the next
    :meth:`mark_evictable`. :meth:`evict` must never return a key that is not
    evictable, nor one in ``protected``.

    Policies run on the scheduler's hot path: every method must be O(1) amortised
    (``evict`` O(n + skipped)), never block and never do I/O.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a cache policy needs a capacity >= 1, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> Any | None:
        """The record of ``key``, or None if the policy does not hold it."""

    @abstractmethod
    def insert(self, key: OffloadKey, record: Any) -> None:
        """Add a key that is not held yet; it is not evictable until marked so."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Forget ``key`` (a write that failed); unknown keys are ignored."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Record a use of ``keys``, the first of which is the head of a prefix.

        Keys the policy does not hold are ignored (or, for adaptive policies, count as
        a hit on their history).
        """

    @abstractmethod
    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, Any]] | None:
        """Remove and return exactly ``n`` evictable keys not in ``protected``.

        All or nothing: if ``n`` such keys do not exist, return None and change
        nothing. ``n == 0`` returns an empty list.
        """

    @abstractmethod
    def clear(self) -> None:
        """Forget every key and any adaptive state."""

    @abstractmethod
    def mark_evictable(self, key: OffloadKey) -> None:
        """``key``'s ref count became 0: it is readable and may be evicted."""

    @abstractmethod
    def mark_non_evictable(self, key: OffloadKey) -> None:
        """``key``'s ref count left 0: a reader pinned it."""


#: Values of :attr:`TrackedPolicy._blocked`.
WRITING = True
PINNED = False


class TrackedPolicy(CachePolicy):
    """A policy base that keeps track of which keys may not be evicted.

    ``_blocked`` maps each non-evictable key to :data:`WRITING` (inserted, not yet
    readable) or :data:`PINNED` (readable, held by a reader). Evictable keys are absent,
    so the common case costs nothing.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._blocked: dict[OffloadKey, bool] = {}

    def mark_evictable(self, key: OffloadKey) -> None:
        self._blocked.pop(key, None)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._blocked[key] = PINNED

    def _note_inserted(self, key: OffloadKey) -> None:
        self._blocked[key] = WRITING

    def _note_removed(self, key: OffloadKey) -> None:
        self._blocked.pop(key, None)

    def _is_candidate(self, key: OffloadKey, protected: Collection[OffloadKey]) -> bool:
        return key not in self._blocked and key not in protected
