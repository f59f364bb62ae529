"""The event loop tier coroutines run on.

An async host shares its own running loop with the tiers. A synchronous host has none,
so the manager starts one on a daemon thread and stops it on shutdown. Either way the
scheduler-facing calls never wait for the loop: they hand work over and return.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["TierLoop"]

_T = TypeVar("_T")


class TierLoop:
    """The host's running loop if there is one, else a loop thread of our own."""

    def __init__(self) -> None:
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.owned = True
            self.loop = asyncio.new_event_loop()
            ready = threading.Event()
            self._thread: threading.Thread | None = threading.Thread(
                target=self._run, args=(ready,), name="kvtier-tiers", daemon=True
            )
            self._thread.start()
            ready.wait()
        else:
            self.owned = False
            self._thread = None
            self.thread_id = threading.get_ident()

    def _run(self, ready: threading.Event) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        self.thread_id = threading.get_ident()
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
        finally:
            # aiofiles and to_thread calls use the default executor: join its threads.
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self.thread_id

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop: now if this is the loop's thread, else soon."""
        if self.in_loop_thread():
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        """Run ``coro`` on the loop and block until it finishes (never from the loop)."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(
                "cannot block the tier event loop from its own thread; await the async "
                "variant of this call instead"
            )
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Stop and close a loop this object started; a host's loop is left alone."""
        if self._thread is None:
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self._thread = None
