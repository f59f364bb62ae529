"""Who holds which key: what peers announced to this node, and what it announces.

The peer index also remembers which holder's copy of a key failed verification: that
copy is *backed off*, skipped by lookups and loads for a wait that doubles with each
further failure, and forgotten after a good transfer or when the key leaves the index.
A transient fault on a link so heals by itself, without the owner announcing the key
again, while a link that keeps corrupting chunks is asked less and less often.

Threads: :meth:`PeerIndex.contains` runs on the scheduler's thread and
:meth:`Announcer.withdraw` is called there under the manager lock, while everything
else runs on the tier event loop. Each class has a lock held only for dict and set
operations; announcements reach the loop through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

from kvtier.keys import OffloadKey
from kvtier.tiers.p2p.errors import LinkError

__all__ = ["MAX_OUTBOX_BACKLOG", "Announcer", "Holder", "Outbox", "PeerIndex"]

# Index changes waiting for one slow reader, beyond its initial key set. Evictions run
# at a few thousand keys a second at most, so a reader this far behind is stuck; it is
# disconnected and resynchronises when it reconnects.
MAX_OUTBOX_BACKLOG = 1 << 20
# A dead holder's entries are removed in slices of this many keys, yielding to the
# loop between slices; contains() already ignores a dead holder's entries.
_DROP_SLICE = 8192
# Back-off doublings stop counting here: 2**64 waits is beyond any cap.
_MAX_DOUBLINGS = 64
# A back-off entry: its (holder, key) tuple, its (failures, until) tuple and the float.
_BACKOFF_ENTRY_BYTES = 2 * sys.getsizeof((None, None)) + sys.getsizeof(1.0)


class Holder(Protocol):
    """A connection to a peer that announced keys (a reader's link)."""

    @property
    def live(self) -> bool:
        """False once the connection ended: its keys can no longer be fetched."""

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered (to pick the least busy holder)."""


H = TypeVar("H", bound=Holder)


class PeerIndex(Generic[H]):
    """Key -> the holders whose owners announced it, and each holder's keys.

    Changed only on the loop thread; read there without the lock and from the
    scheduler's thread (:meth:`contains`) under it. A key's holders are a tuple (one
    holder is the common case, and a tuple costs a third of a set).
    """

    def __init__(
        self,
        *,
        retry_after_s: float = 1.0,
        retry_max_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``retry_after_s`` doubling up to ``retry_max_s``: how long a holder's copy
        of a key is skipped after each failed verification (:meth:`back_off`);
        ``clock`` tells the time for those waits, in seconds."""
        self._lock = threading.Lock()
        self._holders: dict[OffloadKey, tuple[H, ...]] = {}
        self._keys: dict[H, set[OffloadKey]] = {}
        self._retry_after_s = retry_after_s
        self._retry_max_s = retry_max_s
        self._clock = clock
        #: (holder, key) -> (failed verifications in a row, skipped until this time).
        self._backoffs: dict[tuple[H, OffloadKey], tuple[int, float]] = {}
        # The objects the index alone keeps alive, beyond its dicts' and sets' own
        # tables: each (holder, key) pair's key bytes and each key's holder tuple.
        self._object_bytes = 0

    def __len__(self) -> int:
        """Keys some holder announced (including those of dead holders not yet dropped)."""
        return len(self._holders)

    def contains(self, key: OffloadKey) -> bool:
        """Whether a live holder announced ``key`` and its copy is not backed off
        (any thread)."""
        with self._lock:
            holders = self._holders.get(key)
        if holders:
            for holder in holders:
                if holder.live and self._usable(holder, key):
                    return True
        return False

    def _usable(self, holder: H, key: OffloadKey) -> bool:
        # Read without the lock (a dict probe), as the holders are.
        if not self._backoffs:
            return True
        entry = self._backoffs.get((holder, key))
        return entry is None or entry[1] <= self._clock()

    def back_off(self, holder: H, key: OffloadKey) -> float:
        """``holder``'s copy of ``key`` failed verification: skip it for a while.

        Returns the wait: ``retry_after_s`` after a first failure, doubling with each
        further one up to ``retry_max_s``. Nothing is remembered for a key the holder
        no longer announces.
        """
        with self._lock:
            entry = self._backoffs.get((holder, key))
            failures = 1 if entry is None else min(entry[0] + 1, _MAX_DOUBLINGS)
            wait = min(self._retry_max_s, self._retry_after_s * 2.0 ** (failures - 1))
            if key in self._keys.get(holder, ()):
                self._backoffs[(holder, key)] = (failures, self._clock() + wait)
        return wait

    def recovered(self, holder: H, key: OffloadKey) -> bool:
        """``holder``'s copy of ``key`` passed verification: its back-off ends.
        Returns whether it had one."""
        if not self._backoffs:
            return False
        with self._lock:
            return self._backoffs.pop((holder, key), None) is not None

    @property
    def backed_off(self) -> int:
        """(holder, key) pairs with a back-off, whether or not it has run out."""
        return len(self._backoffs)

    def memory_bytes(self) -> int:
        """An estimate of the memory the index holds (loop thread), from ``sys.getsizeof``.

        The tables of the dict and sets are measured when asked (each is one call); the
        key objects and holder tuples are added up as entries come and go, back-offs at a
        fixed cost each. Not counted: the holders themselves (links, each a few hundred
        bytes), and a key object the dict keeps when the holder that first announced it
        withdrew it but another still holds it (the other holder's copy is counted in
        its place).
        """
        tables = sys.getsizeof(self._holders) + sys.getsizeof(self._keys)
        tables += sum(sys.getsizeof(keys) for keys in list(self._keys.values()))
        backoffs = sys.getsizeof(self._backoffs) + len(self._backoffs) * _BACKOFF_ENTRY_BYTES
        return tables + self._object_bytes + backoffs

    def pick(self, key: OffloadKey) -> H | None:
        """The live holder of ``key`` whose copy is not backed off, with the fewest
        requests in flight (loop thread)."""
        best: H | None = None
        for holder in self._holders.get(key, ()):
            if (
                holder.live
                and (best is None or holder.in_flight < best.in_flight)
                and self._usable(holder, key)
            ):
                best = holder
        return best

    def add(self, holder: H, keys: Sequence[OffloadKey]) -> None:
        """``holder`` announced ``keys``."""
        with self._lock:
            holders_of = self._holders
            known = self._keys.setdefault(holder, set())
            size = sys.getsizeof
            grown = 0
            for key in keys:
                if key in known:
                    continue
                known.add(key)
                holders = holders_of.get(key)
                added: tuple[H, ...]
                if holders is None:
                    holders_of[key] = added = (holder,)
                else:
                    holders_of[key] = added = (*holders, holder)
                    grown -= size(holders)
                grown += size(key) + size(added)
            self._object_bytes += grown

    def remove(self, holder: H, keys: Sequence[OffloadKey]) -> None:
        """``holder`` withdrew ``keys`` (or no longer has them)."""
        with self._lock:
            known = self._keys.get(holder)
            if not known:
                return
            for key in keys:
                if key in known:
                    known.discard(key)
                    self._object_bytes -= sys.getsizeof(key)
                    self._discard(key, holder)

    async def drop(self, holder: H) -> None:
        """Forget every key of a dead holder, a slice at a time."""
        with self._lock:
            keys = list(self._keys.pop(holder, ()))
        for start in range(0, len(keys), _DROP_SLICE):
            if start:
                await asyncio.sleep(0)
            with self._lock:
                for key in keys[start : start + _DROP_SLICE]:
                    self._object_bytes -= sys.getsizeof(key)
                    self._discard(key, holder)

    def _discard(self, key: OffloadKey, holder: H) -> None:
        if self._backoffs:
            self._backoffs.pop((holder, key), None)
        holders = self._holders.get(key)
        if holders is None:
            return
        self._object_bytes -= sys.getsizeof(holders)
        rest = tuple(other for other in holders if other is not holder)
        if rest:
            self._holders[key] = rest
            self._object_bytes += sys.getsizeof(rest)
        else:
            del self._holders[key]


class Outbox:
    """Index changes waiting to be sent to one reader, in order.

    Filled under the announcer's lock from any thread; emptied by the session's writer
    on the loop, which it wakes through ``call_soon_threadsafe`` when filled elsewhere.
    Create it on the loop thread.
    """

    def __init__(self, wake: asyncio.Event, *, max_backlog: int = MAX_OUTBOX_BACKLOG) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._wake_event = wake
        self._wake_scheduled = False
        self._max_backlog = max_backlog
        self._changes: deque[tuple[bool, list[OffloadKey]]] = deque()
        self._backlog = 0
        self._overflowed = False

    def push(self, present: bool, keys: list[OffloadKey], *, counted: bool = True) -> None:
        """Queue a change (``present``: announced, else withdrawn); the announcer's lock
        is held. ``counted=False`` for the initial key set, which has no limit."""
        if self._overflowed:
            return
        self._changes.append((present, keys))
        if counted:
            self._backlog += len(keys)
            if self._backlog > self._max_backlog:
                self._overflowed = True
                self._changes.clear()
        self._wake()

    def drain(self) -> list[tuple[bool, list[OffloadKey]]]:
        """The queued changes, consecutive ones of a kind merged; empties the outbox.
        The announcer's lock is held.

        Raises:
            LinkError: the reader fell too far behind (it resynchronises on reconnect).
        """
        if self._overflowed:
            raise LinkError(f"the reader fell more than {self._max_backlog} index changes behind")
        merged: list[tuple[bool, list[OffloadKey]]] = []
        for present, keys in self._changes:
            if merged and merged[-1][0] == present:
                merged[-1][1].extend(keys)
            else:
                merged.append((present, list(keys)))
        self._changes.clear()
        self._backlog = 0
        return merged

    def _wake(self) -> None:
        if threading.get_ident() == self._loop_thread:
            self._wake_event.set()
        elif not self._wake_scheduled:
            self._wake_scheduled = True
            # A closed loop has nobody left to send to.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._wake_on_loop)

    def _wake_on_loop(self) -> None:
        self._wake_scheduled = False
        self._wake_event.set()


class Announcer:
    """The keys this node announces, and the readers that hear about changes.

    ``announce`` runs on the loop (cascades), ``withdraw`` on the scheduler's thread
    (evictions, under the manager lock); both only touch a dict and deques under a
    lock. A new reader gets the whole set and then every later change, under the same
    lock, so it never misses or reorders one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Announced key -> the payload checksum taken when it was stored.
        self._held: dict[OffloadKey, int] = {}
        self._outboxes: list[Outbox] = []

    def __len__(self) -> int:
        return len(self._held)

    def announce(self, keys: Sequence[OffloadKey], checksums: Sequence[int]) -> list[OffloadKey]:
        """Hold ``keys`` (with their payload checksums); returns those that are new."""
        with self._lock:
            added = [key for key in keys if key not in self._held]
            self._held.update(zip(keys, checksums, strict=True))
            if added:
                for outbox in self._outboxes:
                    outbox.push(True, added)
        return added

    def checksum(self, key: OffloadKey) -> int | None:
        """The checksum taken when ``key`` was announced (a dict probe: no lock needed)."""
        return self._held.get(key)

    def withdraw(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Stop holding ``keys``; returns those that were held."""
        with self._lock:
            held = self._held
            removed = [key for key in keys if key in held]
            if removed:
                for key in removed:
                    del held[key]
                for outbox in self._outboxes:
                    outbox.push(False, removed)
        return removed

    def subscribe(self, outbox: Outbox) -> None:
        """Send ``outbox`` every key held now, then every change."""
        with self._lock:
            self._outboxes.append(outbox)
            if self._held:
                outbox.push(True, list(self._held), counted=False)

    def unsubscribe(self, outbox: Outbox) -> None:
        with self._lock:
            if outbox in self._outboxes:
                self._outboxes.remove(outbox)

    def take(self, outbox: Outbox) -> list[tuple[bool, list[OffloadKey]]]:
        """The outbox's changes, consecutive ones of a kind merged; empties it.

        Raises:
            LinkError: the reader fell too far behind (it resynchronises on reconnect).
        """
        with self._lock:
            return outbox.drain()
