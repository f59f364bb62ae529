"""Positional file I/O on region memory, from a small pool of threads.

The fs tier moves each chunk with one ``os.preadv`` / ``os.pwritev`` straight between
its file and the region's slot (DESIGN section 11: no aiofiles on the data path, no
``bytes`` per read), a job's chunks shared by as many threads as the direction's
:class:`~kvtier.tiers._depth.IoDepth` allows.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from kvtier.format import HEADER_BYTES
from kvtier.tiers._depth import IoDepth

__all__ = ["advance", "aligned_header", "in_threads", "read_all", "size_of"]

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


async def in_threads(
    work: Callable[[_Item], _Result],
    items: list[_Item],
    lane: IoDepth,
    item_bytes: int,
) -> list[_Result]:
    """``work`` on every item, from threads of ``lane``'s limiter; the results, in order.

    Each thread takes the next item that no other has taken until none is left: one
    that moves several chunks back to back keeps the disk busy without a trip through
    the event loop between chunks, and a slow file holds up only its own thread. The
    batch asks for :meth:`IoDepth.workers` threads; those beyond the depth wait in the
    limiter and join when the depth rises. Every operation is timed into the lane's
    meter (``item_bytes`` each), and each thread's return lets the lane decide its
    depth.

    Every thread call has ended when this returns or raises, cancelled included: the
    calls are tasks of an anyio task group, whose cancellation waits for each
    ``to_thread.run_sync`` call to return (asyncio's ``gather`` would cancel the
    awaiting tasks and leave their threads writing into slots that the job no longer
    owns). The first exception ``work`` raised is raised once all have ended.
    """
    if not items:
        return []
    pending = deque(range(len(items)))
    results: list[Any] = [None] * len(items)
    failures: list[Exception] = []
    meter = lane.meter
    clock = meter.clock

    def drain() -> None:
        meter.run_started()
        try:
            while True:
                try:
                    index = pending.popleft()  # deques pop atomically across threads
                except IndexError:
                    return
                started = clock()
                results[index] = work(items[index])
                meter.io_done(item_bytes, clock() - started)
        finally:
            meter.run_ended()

    async def worker() -> None:
        if not pending:  # the others took every item while this one waited to start
            return
        try:
            await anyio.to_thread.run_sync(drain, limiter=lane.limiter)
        except Exception as exc:  # raised below, after every thread
            failures.append(exc)
        lane.poll()

    async with anyio.create_task_group() as group:
        for _ in range(lane.workers(len(items))):
            group.start_soon(worker)
    if failures:
        raise failures[0]
    return results


def size_of(path: str | Path) -> int | None:
    """The size of the file at ``path``; None if there is none (or it cannot be seen)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return None


_thread_buffers = threading.local()


def aligned_header() -> mmap.mmap:
    """A page-aligned header buffer for O_DIRECT reads and writes, one per I/O thread."""
    buffer: mmap.mmap | None = getattr(_thread_buffers, "header", None)
    if buffer is None:
        buffer = mmap.mmap(-1, HEADER_BYTES)
        _thread_buffers.header = buffer
    return buffer


def read_all(fd: int, buffers: list[memoryview], total: int) -> int:
    """Fill ``buffers`` from the start of ``fd``, up to ``total`` bytes or the end of
    the file; the bytes read."""
    offset = 0
    while offset < total:
        got = os.preadv(fd, buffers, offset)
        if got <= 0:
            break
        offset += got
        buffers = advance(buffers, got)
    return offset


def advance(buffers: list[memoryview], count: int) -> list[memoryview]:
    """The part of ``buffers`` after the first ``count`` bytes."""
    rest: list[memoryview] = []
    for buffer in buffers:
        if count >= len(buffer):
            count -= len(buffer)
            continue
        rest.append(buffer[count:] if count else buffer)
        count = 0
    return rest
