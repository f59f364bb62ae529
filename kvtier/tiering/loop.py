"""The event loop tier coroutines run on, chosen by whoever builds the manager.

An async host shares its own running loop with the tiers (:class:`HostLoop`). A
synchronous host has none, so it hands the manager a :class:`LoopThread`, a loop on a
thread of its own that the manager stops when it closes. Either way the manager's
scheduler-facing calls never wait for the loop: they hand work over and return.

Blocking calls are portal calls, as in anyio's blocking portal: :meth:`TierLoop.run`
runs an async function on the loop and blocks the calling thread until it returns, so
each blocking method of the manager is one line over its async twin (``close()`` as
well, derived by :mod:`kvtier.resources` as for every resource). A manager without
secondary tiers has no loop; its async methods other than ``aclose`` never suspend,
and :func:`run_inline` runs them to the end on the calling thread.

:class:`Lifecycle` starts and closes the manager: once each, on the tier loop, whoever
asks. A synchronous host starts and closes it from its scheduler thread, an async host
from its own loop, and a facade may do either from a loop that is not the tiers' one;
every caller awaits the one run. Closing hands the close to the tier loop and then,
back on the caller's side, closes a loop thread the manager owns (which cannot be
stopped from on it).
"""

from __future__ import annotations

import asyncio
import threading
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ClassVar, TypeVar

from kvtier.resources import AsyncResource, BlockingResource, Once

__all__ = ["HostLoop", "Lifecycle", "LoopThread", "TierLoop", "run_inline"]

_T = TypeVar("_T")

_Step = Callable[[], Coroutine[Any, Any, None]]


class TierLoop(BlockingResource):
    """Where the tiers' coroutines run; closing it stops a loop it runs itself."""

    loop: asyncio.AbstractEventLoop

    @abstractmethod
    def in_loop_thread(self) -> bool:
        """Whether the calling thread is the loop's own."""

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop: now on the loop's thread, else soon."""
        if self.in_loop_thread():
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def run(self, fn: Callable[[], Coroutine[Any, Any, _T]], timeout: float | None = None) -> _T:
        """Run ``fn()`` on the loop and block until it returns (never on the loop thread)."""
        if self.in_loop_thread():
            raise RuntimeError(
                "this call would block the tier event loop from its own thread; "
                "await its async variant instead"
            )
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    async def run_async(self, fn: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
        """Await ``fn()`` on the tier loop from any event loop."""
        if self.in_loop_thread():
            return await fn()
        future = asyncio.run_coroutine_threadsafe(fn(), self.loop)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Stop a loop this object runs (never from its own thread); idempotent. A
        host's loop is left alone."""


class HostLoop(TierLoop):
    """The async host's own loop: the one running where this object is built."""

    close_blocks: ClassVar[bool] = False

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise RuntimeError(
                    "HostLoop() needs a running event loop; a synchronous host uses LoopThread()"
                ) from None
        self.loop = loop
        self._thread_id = threading.get_ident()

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread_id


class LoopThread(TierLoop):
    """A loop of its own on a daemon thread, for a synchronous host."""

    def __init__(self, name: str = "kvtier-tiers") -> None:
        self.loop = asyncio.new_event_loop()
        self._stopping = asyncio.Event()
        ready = threading.Event()
        self._thread: threading.Thread | None = threading.Thread(
            target=self._main, args=(ready,), name=name, daemon=True
        )
        self._thread.start()
        ready.wait()

    def _main(self, ready: threading.Event) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        self._thread_id = threading.get_ident()
        loop.call_soon(ready.set)
        try:
            # One task for the loop's lifetime, as asyncio.run() has: anyio ties the
            # threads of to_thread.run_sync to the root task it finds, and without one
            # each tier job's task was the root, so every job started threads of its
            # own and its end stopped them (106 worker threads started in one quick
            # run of benchmarks/serving_path.py; 4 with the root task).
            loop.run_until_complete(self._stopping.wait())
        finally:
            # aiofiles and to_thread calls use the default executor: join its threads.
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread_id

    @property
    def running(self) -> bool:
        return self._thread is not None

    def close(self) -> None:
        thread = self._thread
        if thread is None:
            return
        if thread.ident == threading.get_ident():
            raise RuntimeError("a loop thread cannot be stopped from its own thread")
        self._thread = None
        self.loop.call_soon_threadsafe(self._stopping.set)
        thread.join()


def run_inline(fn: Callable[[], Awaitable[_T]]) -> _T:
    """Run ``fn()`` to its end on this thread, for a coroutine that never suspends.

    A manager without secondary tiers has nothing to wait for, so its async methods
    return without suspending; if one ever did, that is a bug, reported here rather
    than hung on.
    """
    coro = fn()
    if not isinstance(coro, Coroutine):
        raise TypeError(f"expected a coroutine function, got {fn!r}")
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("a manager without an event loop was asked to wait for something")


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
