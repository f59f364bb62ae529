"""Resources, the one protocol that closes them, and the tasks they own.

Everything in kvtier that holds something to release is a :class:`Resource`, and every
resource closes the same way:

- ``await x.aclose()`` releases it from async code; ``x.close()`` is the same operation
  for a caller that may block. Both are idempotent and may be mixed: the first call of
  either releases, every later call of either returns at once. Neither raises for a part
  that failed to close: that is logged, and the rest is still released.
- Exactly one of the two holds the implementation; this module derives the other, once.
  A resource whose work runs on an event loop (the facade, a spec, the manager, a tier,
  the S3 client) is an :class:`AsyncResource`: it implements ``aclose()``, and its
  ``close()`` runs that ``aclose()`` to its end, as anyio's blocking portal and
  ``anyio.run`` do: on the resource's own loop when that one runs on another thread (a
  portal call), else on a private loop of the calling thread. A resource whose work is
  synchronous (the region, a worker, copy engines, a loop thread, p2p channels) is a
  :class:`BlockingResource`: it implements ``close()``, and its ``aclose()`` calls it,
  in a worker thread when it may block.
- An owner closes what it owns with the verb it implements itself: an async owner
  awaits its parts' ``aclose()`` (:func:`aclose_all`), a blocking owner calls their
  ``close()`` (:func:`close_all`), and one part failing never keeps the others open.
- ``close()`` of an :class:`AsyncResource` refuses to run on a thread whose event loop
  is running (RuntimeError): it would block that loop, and hang for good if the close
  needs it (the tier loop's own thread). Await ``aclose()`` there.
- ``shutdown()``, on a spec and on the manager, is vLLM's name for ``close()`` and the
  same call, kept for a caller that speaks vLLM's interfaces (the vLLM adapter's manager
  and worker answer vLLM's ``shutdown()`` with ``close()``); kvtier itself calls
  ``close()``.

``async with x:`` closes ``x`` with ``aclose()``; ``with x:`` does with ``close()`` for a
:class:`BlockingResource`. Tasks are never left to themselves: each belongs to one
:class:`TaskSet`, which its owner drains or cancels when it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Iterable
from types import TracebackType
from typing import Any, ClassVar, TypeVar

import anyio.to_thread

from kvtier._logs import describe_failure

__all__ = [
    "AsyncResource",
    "BlockingResource",
    "Once",
    "Resource",
    "TaskSet",
    "aclose_all",
    "close_all",
    "resolve_threadsafe",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R", bound="Resource")
_B = TypeVar("_B", bound="BlockingResource")


class Resource(ABC):
    """Something that must be released: ``await aclose()`` or ``close()``, or ``async with``.

    Both verbs are idempotent, may be mixed, and never raise for a part that failed to
    close (it is logged, the rest is released). Subclass :class:`AsyncResource` or
    :class:`BlockingResource`, which derive one verb from the other.
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
        """Release what this resource holds, without blocking the event loop. Idempotent."""

    @abstractmethod
    def close(self) -> None:
        """Release what this resource holds, blocking this thread until done. Idempotent."""


class AsyncResource(Resource):
    """A resource whose work runs on an event loop: it implements :meth:`aclose`.

    :meth:`close` is derived: it runs :meth:`aclose` to its end and blocks meanwhile.
    """

    @abstractmethod
    async def aclose(self) -> None:
        """Release what this resource holds. Idempotent."""

    def close(self) -> None:
        """:meth:`aclose` for a caller that may block: the same operation.

        It runs on the resource's own loop (:meth:`_home_loop`) if that one runs on
        another thread, else on a private loop of this thread.

        Raises:
            RuntimeError: this thread runs an event loop, which the close would block.
        """
        if _running_loop() is not None:
            raise RuntimeError(
                f"{type(self).__name__}.close() would block the event loop running on this "
                "thread, and never end if closing needs that loop; await aclose() instead"
            )
        home = self._home_loop()
        if home is not None and home.is_running():
            asyncio.run_coroutine_threadsafe(self.aclose(), home).result()
            return
        _run_privately(self.aclose)

    def _home_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop :meth:`aclose` must run on, or None (the default) when any loop will
        do: the manager's close, say, hands its work to the tier loop itself."""
        return None


class BlockingResource(Resource):
    """A resource whose work is synchronous: it implements :meth:`close`.

    :meth:`aclose` is derived: it calls :meth:`close`, in a worker thread unless
    :attr:`close_blocks` is False. ``with`` closes it too.
    """

    #: Whether :meth:`close` may block (joins a thread, waits for copies, unmaps
    #: memory): :meth:`aclose` then runs it in a worker thread, off the event loop. A
    #: close that never blocks runs inline, so it also works where no thread may be
    #: started (a done callback, a loop being shut down).
    close_blocks: ClassVar[bool] = True

    @abstractmethod
    def close(self) -> None:
        """Release what this resource holds. Idempotent."""

    async def aclose(self) -> None:
        """:meth:`close` without blocking the event loop: the same operation."""
        if self.close_blocks:
            # Not abandoned on cancellation: the close ends before the caller goes on.
            await anyio.to_thread.run_sync(self.close)
        else:
            self.close()

    def __enter__(self: _B) -> _B:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


async def aclose_all(label: str, parts: Iterable[Resource]) -> None:
    """Await each part's :meth:`~Resource.aclose`, in order, however the others went.

    A part that fails to close is logged under ``label``; the rest still close.
    """
    for part in parts:
        await _aclose_one(label, part)


def close_all(label: str, parts: Iterable[Resource]) -> None:
    """Call each part's :meth:`~Resource.close`, in order, however the others went.

    A part that fails to close is logged under ``label``; the rest still close.
    """
    for part in parts:
        _close_one(label, part)


async def _aclose_one(label: str, part: Resource) -> None:
    try:
        await part.aclose()
    except Exception as exc:
        logger.error(
            "%s: %r failed to close; closing the rest: %s", label, part, describe_failure(exc)
        )


def _close_one(label: str, part: Resource) -> None:
    try:
        part.close()
    except Exception as exc:
        logger.error(
            "%s: %r failed to close; closing the rest: %s", label, part, describe_failure(exc)
        )


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _run_privately(fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``fn()`` to its end on a new event loop of this thread, then close that loop.

    Not ``asyncio.run``: that would also clear this thread's current event loop, which
    belongs to the host.
    """
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(fn())
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


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
            name = task.get_name()
            logger.error("%s: task %s failed: %s", self._label, name, describe_failure(error))

    # ASYNC109: the timeout's outcome is returned, not raised, so no cancel scope would do.
    async def wait(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Wait until no task is left, at most ``timeout`` s; whether none is left."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._tasks:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            await asyncio.wait(list(self._tasks), timeout=remaining)
        return True

    async def aclose(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109
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
    if _running_loop() is loop:
        _set_result(future, value)
        return
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_set_result, future, value)


def _set_result(future: asyncio.Future[_T], value: _T) -> None:
    if not future.done():
        future.set_result(value)
