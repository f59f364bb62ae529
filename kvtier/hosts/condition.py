"""A condition that asyncio tasks and threads wait on alike.

A host's own state (its fence, the claims of its requests) is shared by whoever calls
it: the tasks of one event loop for the async facade, any number of threads for the
page store. :class:`Condition` guards that state with one lock and wakes both kinds of
waiter when it changes, so each piece of state is written once, for both.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

from kvtier.resources import resolve_threadsafe

__all__ = ["Condition", "Flag", "cancel_threadsafe"]

_T = TypeVar("_T")


class Condition:
    """State guarded by one lock, and the tasks and threads that wait for it to change.

    Change the state inside ``with condition.lock:`` and call :meth:`changed` before
    leaving: every waiter then checks its predicate again. A thread waits in
    :meth:`when_blocking`, a task awaits :meth:`when`; both check the predicate and act
    on it under the lock, so what they saw still holds when they act. The lock is held
    only for those checks and changes, never while anyone waits, so taking it on an
    event loop's thread never stalls the loop.
    """

    def __init__(self) -> None:
        #: The lock guarding the state (a ``threading.Condition``, which waiting
        #: threads sleep on).
        self.lock = threading.Condition()
        self._futures: list[asyncio.Future[None]] = []

    def changed(self) -> None:
        """Wake every waiter (call it with the lock held, after changing the state)."""
        self.lock.notify_all()
        futures, self._futures = self._futures, []
        for future in futures:
            resolve_threadsafe(future, None)

    def when_blocking(self, ready: Callable[[], bool], then: Callable[[], _T]) -> _T:
        """Block the calling thread until ``ready()`` holds, then return ``then()``,
        both under the lock."""
        with self.lock:
            self.lock.wait_for(ready)
            return then()

    async def when(self, ready: Callable[[], bool], then: Callable[[], _T]) -> _T:
        """Wait, without blocking the loop, until ``ready()`` holds, then return
        ``then()``, both under the lock."""
        loop = asyncio.get_running_loop()
        while True:
            with self.lock:
                if ready():
                    return then()
                future: asyncio.Future[None] = loop.create_future()
                self._futures.append(future)
            await future


class Flag:
    """Something that happens once (a claimed chunk stored), awaited or waited for."""

    def __init__(self) -> None:
        self._state = Condition()
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._state.lock:
            self._set = True
            self._state.changed()

    async def wait(self) -> None:
        await self._state.when(self.is_set, _nothing)


def cancel_threadsafe(future: asyncio.Future[object]) -> None:
    """Cancel ``future`` from any thread (on its own loop's thread at once)."""
    loop = future.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        future.cancel()
        return
    with contextlib.suppress(RuntimeError):  # a closed loop has nobody waiting
        loop.call_soon_threadsafe(future.cancel)


def _nothing() -> None:
    return None
