"""Starting and closing the manager: once each, on the tier loop, whoever asks.

A synchronous host starts and closes the manager from its scheduler thread, an async
host from its own loop, and a facade may do either from a loop that is not the tiers'
one. :class:`Lifecycle` runs the manager's start and close coroutines on the tier loop
in every case, at most once each, with every caller awaiting that one run. Starting
blocks through one portal call over its async twin (:meth:`TierLoop.run`). Closing is
an :class:`~kvtier.resources.AsyncResource`: :meth:`Lifecycle.aclose` hands the close to
the tier loop and then, back on the caller's side, closes a loop thread it owns (which
cannot be stopped from on it); the blocking ``close()`` is derived from it. A manager
without secondary tiers has no loop: its coroutines run on the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvtier.resources import AsyncResource, Once
from kvtier.tiering.loop import TierLoop, run_inline

__all__ = ["Lifecycle"]

_T = TypeVar("_T")

_Step = Callable[[], Coroutine[Any, Any, None]]


class Lifecycle(AsyncResource):
    """When the manager may work: started, closing, released.

    ``start`` brings the tiers up; ``close`` drains and closes them. :attr:`closed`
    turns True when closing begins or a start fails, and stays so: the manager then
    submits no new tier work. :attr:`released` turns True once the loop is given back.
    """

    def __init__(self, loop: TierLoop | None, start: _Step, close: _Step) -> None:
        self._loop = loop
        self._start_fn = start
        self._close_fn = close
        self._starting = Once(self._start)
        self._closing = Once(self._close)
        self.started = loop is None
        self.closed = False
        self.released = False

    async def start(self) -> None:
        if not self.started:
            await self.on_loop(self._starting)

    def start_blocking(self, timeout: float | None = None) -> None:
        self.block_on(self.start, timeout)

    async def _start(self) -> None:
        try:
            await self._start_fn()
        except BaseException:
            self.closed = True
            raise
        self.started = True

    async def wait_started(self) -> None:
        """Wait for a start that has begun to end, whatever its outcome."""
        await self._starting.wait()

    async def aclose(self) -> None:
        """Close on the tier loop (once, whoever asks), then release the loop."""
        if self.released:
            return
        await self.on_loop(self._closing)
        self.released = True
        loop = self._loop
        if loop is not None and not loop.in_loop_thread():
            await loop.aclose()

    async def _close(self) -> None:
        self.closed = True
        await self._close_fn()

    async def on_loop(self, fn: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
        """Await ``fn()`` on the tier loop, whichever loop the caller is on (on the
        caller's when there is no tier loop)."""
        if self._loop is None:
            return await fn()
        return await self._loop.run_async(fn)

    def block_on(
        self, fn: Callable[[], Coroutine[Any, Any, _T]], timeout: float | None = None
    ) -> _T:
        """Run ``fn()`` on the tier loop and block this thread until it returns."""
        if self._loop is None:
            return run_inline(fn)
        return self._loop.run(fn, timeout)
