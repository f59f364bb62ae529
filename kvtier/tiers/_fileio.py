"""Positional file I/O on region memory, from a small pool of threads.

The fs tier moves each chunk with one ``os.preadv`` / ``os.pwritev`` straight between
its file and the region's slot (DESIGN section 11: no aiofiles on the data path, no
``bytes`` per read), a job's chunks spread over at most ``depth`` threads.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread

from kvtier.format import HEADER_BYTES

__all__ = ["advance", "aligned_header", "in_threads", "read_all", "size_of"]

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


async def in_threads(
    work: Callable[[list[_Item]], list[_Result]],
    items: list[_Item],
    depth: int,
    limiter: anyio.CapacityLimiter | None,
) -> list[_Result]:
    """``work`` on ``items`` cut into at most ``depth`` contiguous runs, each run in a
    thread of ``limiter``; every result, in order.

    A thread that moves several chunks back to back keeps the disk busy without a trip
    through the event loop between chunks. Every thread call has ended when this
    returns or raises, cancelled included: the runs are tasks of an anyio task group,
    whose cancellation waits for each ``to_thread.run_sync`` call to return (asyncio's
    ``gather`` would cancel the awaiting tasks and leave their threads writing into
    slots that the job no longer owns).
    """
    if not items:
        return []
    count = min(depth, len(items))
    size, extra = divmod(len(items), count)
    bounds = [i * size + min(i, extra) for i in range(count + 1)]
    runs: list[list[_Result] | BaseException] = [[] for _ in range(count)]

    async def run(index: int, part: list[_Item]) -> None:
        try:
            runs[index] = await anyio.to_thread.run_sync(work, part, limiter=limiter)
        except Exception as exc:  # the first failure is raised below, after every run
            runs[index] = exc

    async with anyio.create_task_group() as group:
        for index, (start, end) in enumerate(itertools.pairwise(bounds)):
            group.start_soon(run, index, items[start:end])
    results: list[_Result] = []
    for outcome in runs:
        if isinstance(outcome, BaseException):
            raise outcome
        results.extend(outcome)
    return results


def size_of(path: Path) -> int | None:
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
