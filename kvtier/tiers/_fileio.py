"""Positional file I/O on region memory, from a small pool of threads.

The fs tier moves each chunk with one ``os.preadv`` / ``os.pwritev`` straight between
its file and the region's slot (no aiofiles on the data path: each of its calls hops
to a thread and back and builds a ``bytes`` per read), a job's chunks shared by as
many of the direction's own threads as its :class:`~kvtier.tiers._depth.IoDepth`
allows.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

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
    """``work`` on every item, from ``lane``'s threads, at most its depth at once; the
    results, in order.

    Each thread takes the next item no other has taken, so one that moves several
    chunks back to back keeps the disk busy without a trip through the event loop
    between chunks, and a slow file holds up only its own thread; a depth raised while
    the batch runs is taken up at once. Every operation is timed into the lane's meter
    (``item_bytes`` each), and the lane decides its depth when the batch ends.

    Every thread call has ended when this returns or raises, cancelled included
    (cancelled, the items not begun yet are dropped): a thread never writes into a
    slot the job no longer owns. The first exception ``work`` raised is raised once
    all have ended.
    """
    try:
        return await lane.threads.run(work, items, item_bytes)
    finally:
        lane.poll()


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
