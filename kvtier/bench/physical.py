"""The physical limits a benchmark compares kvtier against, measured on the spot.

Raw disk: files of one chunk each written with ``os.pwritev`` (O_DIRECT when asked),
synced, evicted from the page cache and read back with ``os.preadv``, by one thread
and by several; the better figure is the limit. Memory: a plain copy between two
buffers larger than the caches.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DiskLimits", "drop_page_cache", "measure_disk", "measure_memcpy"]

_HEADER = 4096


@dataclass(frozen=True)
class DiskLimits:
    write_gbps: float
    read_gbps: float


def drop_page_cache(files: list[Path]) -> None:
    """Evict ``files`` (clean, after a sync) from the page cache, as far as allowed."""
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    for path in files:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _one_pass(directory: Path, count: int, chunk: int, threads: int, direct: bool) -> DiskLimits:
    directory.mkdir(parents=True)
    # Page-aligned buffers: O_DIRECT needs them, as kvtier's region rows are.
    source = mmap.mmap(-1, _HEADER + chunk)
    source[_HEADER:] = os.urandom(chunk)
    paths = [directory / f"{i:06d}.raw" for i in range(count)]
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (getattr(os, "O_DIRECT", 0) if direct else 0)

    def write(path: Path) -> None:
        fd = os.open(path, flags, 0o644)
        try:
            os.pwritev(fd, [memoryview(source)], 0)
        finally:
            os.close(fd)

    def read(path: Path) -> None:
        into = bytearray(_HEADER + chunk)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [memoryview(into)], 0)
        finally:
            os.close(fd)

    try:
        with ThreadPoolExecutor(threads) as pool:
            started = time.perf_counter()
            list(pool.map(write, paths))
            os.sync()
            write_s = time.perf_counter() - started
            drop_page_cache(paths)
            started = time.perf_counter()
            list(pool.map(read, paths))
            read_s = time.perf_counter() - started
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        source.close()
    total = count * chunk
    return DiskLimits(total / write_s / 1e9, total / read_s / 1e9)


def measure_disk(
    directory: Path, count: int, chunk: int, *, depth: int = 4, direct: bool = False
) -> DiskLimits:
    """Best raw write and cold read bandwidth of ``count`` one-chunk files in ``directory``."""
    passes = [
        _one_pass(directory / f"raw-{threads}", count, chunk, threads, direct)
        for threads in sorted({1, depth})
    ]
    return DiskLimits(max(p.write_gbps for p in passes), max(p.read_gbps for p in passes))


def measure_memcpy(nbytes: int = 256 << 20, repeats: int = 4) -> float:
    """GB/s of a plain copy between two buffers of ``nbytes``."""
    source = bytearray(os.urandom(1 << 20)) * (nbytes >> 20)
    target = bytearray(len(source))
    view_in, view_out = memoryview(source), memoryview(target)
    view_out[:] = view_in  # first touch outside the timing
    started = time.perf_counter()
    for _ in range(repeats):
        view_out[:] = view_in
    return len(source) * repeats / (time.perf_counter() - started) / 1e9
