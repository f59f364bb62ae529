"""Resources and the tasks they own.

Everything in kvtier that holds something to release (a tier, the tier runner, the
manager, a worker, the facade) is an :class:`AsyncResource`: ``await x.aclose()``
releases it, a second call does nothing, and ``async with x:`` closes it on the way
out. Tasks are never left to themselves: each belongs to one :class:`TaskSet`, which
its owner drains or cancels when it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["AsyncResource", "Once", "TaskSet", "resolve_threadsafe"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R", bound="AsyncResource")


class AsyncResource(ABC):
    """Something that must be released: ``aclose()``, or ``async with``.

    :meth:`aclose` is idempotent: the first call releases, later calls return at once.
    It never raises for something that failed to close on the way: that is logged, and
    everything else is still released.
    """

    async def __aenter__(self: _R) -> _R:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @abstractmethod
    async def aclose(self) -> None:
        """Release what this resource holds. Idempotent."""


class TaskSet:
    """The tasks one owner started.

    :meth:`spawn` starts a task and keeps it until it ends; :meth:`wait` waits until
    every task (those spawned meanwhile too) has ended; :meth:`aclose` cancels what
    is left and waits for it. A task's exception is retrieved when it ends, and logged
    unless ``log_failures`` is False (an owner that reports failures itself).
    """

    def __init__(self, label: str, *, log_failures: bool = True) -> None:
        self._label = label
        self._log_failures = log_failures
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def __bool__(self) -> bool:
        return bool(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, _T], *, name: str | None = None) -> asyncio.Task[_T]:
        """Start ``coro`` as a task of this set, on the running loop."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and self._log_failures:
            logger.error("%s: task %s failed", self._label, task.get_name(), exc_info=error)

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait until no task is left, at most ``timeout`` s; whether none is left."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._tasks:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            await asyncio.wait(list(self._tasks), timeout=remaining)
        return True

    async def aclose(self, timeout: float | None = None) -> bool:
        """Cancel every task and wait for them, at most ``timeout`` s; whether all ended."""
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            if pending:
                return False
        return True


class Once:
    """An async operation that runs at most once; every caller awaits that one run.

    The run is a task of its own, so a caller that is cancelled stops waiting without
    stopping it; a failure reaches every caller.
    """

    def __init__(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._fn = fn
        self._run: asyncio.Future[None] | None = None

    @property
    def begun(self) -> bool:
        return self._run is not None

    @property
    def running(self) -> bool:
        return self._run is not None and not self._run.done()

    async def __call__(self) -> None:
        if self._run is None:
            self._run = asyncio.ensure_future(self._fn())
        await asyncio.shield(self._run)

    async def wait(self) -> None:
        """Wait for a run that has begun to end, whatever its outcome."""
        if self._run is not None and not self._run.done():
            await asyncio.wait({self._run})


def resolve_threadsafe(future: asyncio.Future[_T], value: _T) -> None:
    """Set ``future``'s result from any thread, unless it is done already.

    On the future's own loop thread the result is set at once; from another thread it
    is handed to that loop. A closed loop has nobody waiting, so nothing happens.
    """
    loop = future.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        _set_result(future, value)
        return
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_set_result, future, value)


def _set_result(future: asyncio.Future[_T], value: _T) -> None:
    if not future.done():
        future.set_result(value)
