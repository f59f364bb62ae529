"""The completion queue: outcomes in from any thread, and whoever waits woken up."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Iterator

from kvtier.resources import resolve_threadsafe
from kvtier.tiering.outcomes import Outcome

__all__ = ["CompletionQueue"]


class CompletionQueue:
    """Outcomes the tier side posts, drained by the manager under its lock.

    :meth:`post` may run on any thread and never blocks. Every post, and every
    :meth:`notify` (the manager's own completions: a store or load finishing), wakes
    the tasks and threads waiting in :meth:`wait` / :meth:`wait_blocking`. Waiters read
    :attr:`seq` before they check their condition and wait for it to change, so a
    wake-up between the check and the wait is never lost.
    """

    def __init__(self, on_post: Callable[[], None]) -> None:
        self._items: deque[Outcome] = deque()
        self._on_post = on_post
        self.seq = 0
        self._cond = threading.Condition()
        self._futures: list[asyncio.Future[None]] = []

    def __bool__(self) -> bool:
        return bool(self._items)

    def post(self, outcome: Outcome) -> None:
        self._items.append(outcome)
        self.notify()
        self._on_post()

    def drain(self) -> Iterator[Outcome]:
        """Take the queued outcomes, oldest first, including those posted meanwhile."""
        items = self._items
        while items:
            yield items.popleft()

    def notify(self) -> None:
        with self._cond:
            self.seq += 1
            self._cond.notify_all()
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
            self._cond.wait_for(lambda: self.seq != seq, timeout)
