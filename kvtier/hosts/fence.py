"""The fence: a host's operations run side by side; a reset, clear or close runs alone."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from kvtier.hosts.condition import Condition, cancel_threadsafe

__all__ = ["Fence"]

_T = TypeVar("_T")


class Fence:
    """Operations run side by side; a fence (reset, clear, close) runs alone.

    An operation (a lookup, load or store) enters through :meth:`operation` from a task
    or :meth:`operation_blocking` from a thread; while a fence stands, new operations
    wait for it to go. :meth:`fenced` / :meth:`fenced_blocking` raise the fence,
    interrupt the operations that wait for tier work through :meth:`wait_unless_raised`
    (they give up), wait until no operation is left, and only then run their body.
    Fences take turns. A fence raised with ``closing`` closes the host for good: an
    operation entering after it is told so (and is not counted).

    One state under one :class:`~kvtier.hosts.condition.Condition`: the async face and
    the blocking face are the same fence, and may be used together. A thread waiting
    for tier work cannot be interrupted; it sees the fence when its wait ends (by its
    deadline at the latest).
    """

    def __init__(self) -> None:
        self._state = Condition()
        self._active = 0
        self._raised = False
        self._closed = False
        #: Waits of operations for tier work: cancelled when a fence goes up.
        self._waits: set[asyncio.Future[Any]] = set()

    @property
    def raised(self) -> bool:
        """Whether a fence stands (operations in flight should give up waiting)."""
        return self._raised

    @property
    def active(self) -> int:
        """Operations in flight now."""
        return self._active

    @property
    def closed(self) -> bool:
        """Whether a closing fence went up."""
        return self._closed

    # ------------------------------------------------------------ operations

    @contextlib.asynccontextmanager
    async def operation(self, check: Callable[[], None] | None = None) -> AsyncIterator[bool]:
        """Run an operation (a task): yields whether the host is open.

        ``check`` runs once the operation may enter, before it is counted; what it
        raises keeps the operation out.
        """
        entered = await self._when(lambda: self._enter(check))
        try:
            yield entered
        finally:
            if entered:
                self._leave()

    @contextlib.contextmanager
    def operation_blocking(self, check: Callable[[], None] | None = None) -> Iterator[bool]:
        """:meth:`operation` for a thread."""
        entered = self._when_blocking(lambda: self._enter(check))
        try:
            yield entered
        finally:
            if entered:
                self._leave()

    async def wait_unless_raised(
        self, waiting: Coroutine[Any, Any, Any], deadline: float | None
    ) -> None:
        """Await ``waiting`` until it is done, the ``deadline`` (``time.monotonic()``)
        passes, or a fence goes up (which cancels it); at once if one stands already."""
        remaining = None if deadline is None else deadline - time.monotonic()
        with self._state.lock:
            # Checked and registered under one lock: a fence raised from a thread in
            # between would otherwise miss this wait, which then runs to its deadline.
            if self._raised or (remaining is not None and remaining <= 0):
                waiting.close()
                return
            wait = asyncio.ensure_future(waiting)
            self._waits.add(wait)
        try:
            await asyncio.wait({wait}, timeout=remaining)
        finally:
            with self._state.lock:
                self._waits.discard(wait)
            wait.cancel()

    # ---------------------------------------------------------------- fences

    @contextlib.asynccontextmanager
    async def fenced(self, *, closing: bool = False) -> AsyncIterator[bool]:
        """Run the body alone (a task): yields whether the host was open."""
        was_open = await self._when(lambda: self._raise(closing))
        try:
            await self._state.when(self._idle, _nothing)
            yield was_open
        finally:
            self._lower()

    @contextlib.contextmanager
    def fenced_blocking(self, *, closing: bool = False) -> Iterator[bool]:
        """:meth:`fenced` for a thread."""
        was_open = self._when_blocking(lambda: self._raise(closing))
        try:
            self._state.when_blocking(self._idle, _nothing)
            yield was_open
        finally:
            self._lower()

    # ------------------------------------------- the state (under the lock)

    async def _when(self, then: Callable[[], _T]) -> _T:
        """``then()`` once no fence stands (at once, without waiting, if none does)."""
        with self._state.lock:
            if not self._raised:
                return then()
        return await self._state.when(self._lowered, then)

    def _when_blocking(self, then: Callable[[], _T]) -> _T:
        with self._state.lock:
            if not self._raised:
                return then()
        return self._state.when_blocking(self._lowered, then)

    def _lowered(self) -> bool:
        return not self._raised

    def _idle(self) -> bool:
        return self._active == 0

    def _enter(self, check: Callable[[], None] | None) -> bool:
        if check is not None:
            check()
        if self._closed:
            return False
        self._active += 1
        return True

    def _leave(self) -> None:
        with self._state.lock:
            self._active -= 1
            if self._active == 0:
                self._state.changed()

    def _raise(self, closing: bool) -> bool:
        was_open = not self._closed
        self._raised = True
        self._closed = self._closed or closing
        for wait in self._waits:
            cancel_threadsafe(wait)
        return was_open

    def _lower(self) -> None:
        with self._state.lock:
            self._raised = False
            self._state.changed()


def _nothing() -> None:
    return None
