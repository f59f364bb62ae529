"""The completion queue: outcomes in from any thread, applied under the manager's lock.

Tier coroutines never touch manager state: whatever they have to say goes into the
completion queue as one of the outcome records below, and the tiering core applies them
under the manager's lock at its poll points. :class:`OutcomeServer` also applies
outcomes on the tier loop soon after they are posted, so a tier waiting for pins, or a
host waiting for a completion, needs no scheduler step to move on.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, Union

from kvtier.keys import OffloadKey
from kvtier.resources import resolve_threadsafe
from kvtier.tiering.ledger import Holder
from kvtier.tiering.loop import TierLoop
from kvtier.tiers.base import JobResult, TransferJob

__all__ = [
    "CompletionQueue",
    "JobOutcome",
    "JobReleased",
    "LookupOutcome",
    "Outcome",
    "OutcomeServer",
    "PinRequest",
    "SettleSlots",
    "TierPins",
    "UnpinRequest",
]


@dataclass(frozen=True, slots=True)
class LookupOutcome:
    """A batch of async lookups ended."""

    runner: int
    keys: tuple[OffloadKey, ...]
    #: One answer per key, or None when the lookup failed or timed out.
    answers: tuple[bool, ...] | None
    elapsed: float


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """A store or load job ended, or timed out."""

    runner: int
    job: TransferJob
    result: JobResult
    #: Seconds from submission (queueing included) to the outcome.
    elapsed: float
    #: False when the job timed out and the tier may still use its slots.
    released: bool


@dataclass(frozen=True, slots=True)
class JobReleased:
    """The coroutine of a job that timed out has returned (a late completion)."""

    runner: int
    job: TransferJob


@dataclass(frozen=True, slots=True)
class SettleSlots:
    """Time to look again whether late I/O still touches the slots kept for it."""


@dataclass(frozen=True, slots=True)
class PinRequest:
    """A tier asks to pin readable primary slots by key (pinned reads, p2p)."""

    holder: Holder
    keys: tuple[OffloadKey, ...]
    future: asyncio.Future[dict[OffloadKey, memoryview]]


@dataclass(frozen=True, slots=True)
class UnpinRequest:
    """A tier releases pins a :class:`PinRequest` took."""

    holder: Holder
    keys: tuple[OffloadKey, ...]


Outcome = Union[  # noqa: UP007 - a runtime alias on Python 3.10
    LookupOutcome, JobOutcome, JobReleased, PinRequest, UnpinRequest, SettleSlots
]


class TierPins:
    """What a tier's :class:`~kvtier.tiers.base.PrimaryAccess` is bound to: its pin and
    unpin requests travel to the manager through the completion queue, since the
    primary tier has one writer; they are served under the manager's lock and the pins
    are held in the slot ledger under the tier's name. Called on any thread."""

    def __init__(self, holder: Holder, post: Callable[[Outcome], None]) -> None:
        self._holder = holder
        self._post = post

    def request_pins(
        self,
        keys: tuple[OffloadKey, ...],
        future: asyncio.Future[dict[OffloadKey, memoryview]],
    ) -> None:
        self._post(PinRequest(self._holder, keys, future))

    def release_pins(self, keys: tuple[OffloadKey, ...]) -> None:
        self._post(UnpinRequest(self._holder, keys))


# How soon the tier loop tries again to apply outcomes when the host holds the lock:
# the host's own calls drain them anyway; this bounds the wait of an idle host.
_SERVE_RETRY_S = 0.001


class CompletionQueue:
    """Outcomes the tier side posts, drained by the manager under its lock.

    :meth:`post` may run on any thread and never blocks. Every post, and every
    :meth:`notify` (the manager's own completions: a store or load finishing), wakes
    the tasks and threads waiting in :meth:`wait` / :meth:`wait_blocking`. Waiters read
    :attr:`seq` before they check their condition and wait for it to change, so a
    wake-up between the check and the wait is never lost.
    """

    def __init__(self, on_post: Callable[[], None]) -> None:
        #: The outcomes not applied yet. Read, never changed, outside this class: the
        #: manager's hot paths test it directly (a deque's truth is a C call, where
        #: ``bool(queue)`` would be a Python one on every lookup).
        self.pending: deque[Outcome] = deque()
        self._on_post = on_post
        self.seq = 0
        self._cond = threading.Condition()
        # Threads in wait_blocking: a notify with none skips the condition's
        # notify_all, a tenth of a store cycle's cost through vLLM's interface.
        self._sleepers = 0
        self._futures: list[asyncio.Future[None]] = []

    def __bool__(self) -> bool:
        return bool(self.pending)

    def post(self, outcome: Outcome) -> None:
        self.pending.append(outcome)
        self.notify()
        self._on_post()

    def drain(self) -> Iterator[Outcome]:
        """Take the queued outcomes, oldest first, including those posted meanwhile."""
        items = self.pending
        while items:
            yield items.popleft()

    def notify(self) -> None:
        with self._cond:
            self.seq += 1
            if self._sleepers:
                self._cond.notify_all()
            if not self._futures:
                return
            futures, self._futures = self._futures, []
        for future in futures:
            resolve_threadsafe(future, None)

    async def wait(self, seq: int) -> None:
        """Resolve once :meth:`notify` ran after ``seq`` was read."""
        future = asyncio.get_running_loop().create_future()
        with self._cond:
            if self.seq != seq:
                return
            self._futures.append(future)
        await future

    def wait_blocking(self, seq: int, timeout: float | None = None) -> None:
        with self._cond:
            self._sleepers += 1
            try:
                self._cond.wait_for(lambda: self.seq != seq, timeout)
            finally:
                self._sleepers -= 1

    async def wait_for_any(self, since: int | None = None) -> None:
        """Resolve once something completes after :attr:`seq` read ``since``; without
        a mark, once something completes from now on, or at once if an outcome waits
        to be applied.

        With a mark there is no shortcut for a queued outcome: one posted before the
        mark was read was there for the caller's check to apply, and one posted after
        it changed :attr:`seq` already; a shortcut would only spin a caller whose check
        applies nothing until the loop applies the outcome (which notifies)."""
        if since is None:
            if self.pending:
                return
            since = self.seq
        await self.wait(since)

    def wait_for_any_blocking(self, timeout: float | None = None, since: int | None = None) -> None:
        """:meth:`wait_for_any` for a thread, for at most ``timeout`` seconds."""
        if since is None:
            if self.pending:
                return
            since = self.seq
        self.wait_blocking(since, timeout)


class _Lock(Protocol):
    def acquire(self, blocking: bool = ...) -> bool: ...

    def release(self) -> None: ...


class OutcomeServer:
    """Applies posted outcomes on the tier loop, under ``lock``, soon after each post.

    ``drain`` applies what :attr:`queue` holds; it runs with ``lock`` held. One serve
    is scheduled at a time; if the host holds the lock, the loop tries again a
    millisecond later rather than waiting for it. Without a loop (a manager with no
    secondary tiers) nothing is ever posted, and nothing is scheduled.
    """

    def __init__(self, lock: _Lock, loop: TierLoop | None, drain: Callable[[], None]) -> None:
        self._lock = lock
        self._loop = loop
        self._drain = drain
        self._scheduled = False
        self.queue = CompletionQueue(self._schedule)

    def _schedule(self) -> None:
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            try:
                self._loop.call(self._serve)
            except RuntimeError:  # the loop is closed: closing drains what is left
                self._scheduled = False

    def _serve(self) -> None:
        assert self._loop is not None
        if not self._lock.acquire(blocking=False):
            self._loop.loop.call_later(_SERVE_RETRY_S, self._serve)
            return
        try:
            self._scheduled = False
            if self.queue:
                self._drain()
        finally:
            self._lock.release()
        self.queue.notify()
