"""The eviction-policy interface of the primary tier."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterator, Sequence
from typing import Any

from kvtier.keys import OffloadKey

__all__ = ["CachePolicy", "PrefixOrder", "TrackedPolicy"]


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

    def follow(self, keys: Sequence[OffloadKey], owner: Hashable) -> None:
        """``owner`` (a request) stored, promoted or loaded ``keys``, its prefix in
        order (head first), all of which the policy holds.

        The primary tier calls it after each store and promotion (once the keys are
        inserted) and each load of a request; one owner's calls, taken together,
        follow its prefix from head to tail. A policy that keeps prefixes whole ranks
        an owner's keys as one prefix, whatever the number of calls. By default a
        use is a :meth:`touch`.
        """
        self.touch(keys)

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


class PrefixOrder:
    """Keys in runs, one run per owner, the least recently used run first.

    A run holds the keys one owner used, in the order it last used them: for a
    request, its prefix from head to tail. A use moves the owner's run to the recent
    end and the keys it names to the run's tail, taking them from other runs.
    :meth:`oldest` walks the runs from the least recent and each run from its tail, so
    eviction in that order takes a prefix's tail before its head, and an older
    request's prefix before a newer one's, whether the owner stored its prefix in one
    call or many. Owners are request ids (or any object that is not a key: a key
    inserted without an owner is a run of its own, named by itself).
    """

    def __init__(self) -> None:
        self._runs: OrderedDict[Hashable, dict[OffloadKey, Any]] = OrderedDict()
        self._owner: dict[OffloadKey, Hashable] = {}

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, key: object) -> bool:
        return key in self._owner

    def get(self, key: OffloadKey) -> Any | None:
        owner = self._owner.get(key)
        return None if owner is None else self._runs[owner][key]

    def insert(self, key: OffloadKey, record: Any, owner: Hashable | None = None) -> None:
        """Add a key that is not held, at the tail of ``owner``'s run, now the most
        recent; without an owner, in a run of its own until a use names one."""
        if owner is None:
            owner = key
        run = self._runs.get(owner)
        if run is None:
            run = self._runs[owner] = {}
        else:
            self._runs.move_to_end(owner)
        run[key] = record
        self._owner[key] = owner

    def pop(self, key: OffloadKey) -> Any | None:
        """Remove ``key``; its record, or None if it is not held."""
        owner = self._owner.pop(key, None)
        if owner is None:
            return None
        run = self._runs[owner]
        record = run.pop(key)
        if not run:
            del self._runs[owner]
        return record

    def use(self, key: OffloadKey, owner: Hashable) -> None:
        """``owner`` used ``key`` (held): its run becomes the most recent and ends with
        ``key``, wherever ``key`` was, so that a use of a whole prefix orders the run
        as that prefix."""
        self.insert(key, self.pop(key), owner)

    def oldest(self) -> Iterator[tuple[OffloadKey, Any]]:
        """Every key with its record: the least recent run first, each run tail first."""
        for run in self._runs.values():
            for key in reversed(run):
                yield key, run[key]

    def clear(self) -> None:
        self._runs.clear()
        self._owner.clear()
