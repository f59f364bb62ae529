"""The physical limits a benchmark compares kvtier against, measured on the spot.

Raw disk: files of one chunk each written with ``os.pwritev`` and read back cold with
``os.preadv`` (both O_DIRECT when asked, as the fs tier does), synced and evicted from
the page cache in between, by one thread and by as many as the tier's depths; the best
figure is the limit.
Memory: a plain copy between two buffers larger than the caches. Network: chunks sent
over loopback TCP between two threads. (A tier's own limit may live with the tier: the
s3 tier's PUT/GET by a plain client is in :mod:`kvtier.tiers.s3.bench`.)
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvtier.format import ChunkFormat

__all__ = [
    "DiskLimits",
    "drop_page_cache",
    "measure_checksum",
    "measure_disk",
    "measure_loopback",
    "measure_memcpy",
    "measure_reads",
    "recv_exactly",
    "time_checksums",
]

_HEADER = 4096
#: As many as the fs tier spreads its chunk files over.
_SUBDIRECTORIES = 256


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


def _one_pass(
    directory: Path,
    count: int,
    chunk: int,
    threads: int,
    direct: bool,
    keep: bool,
    step: Callable[[str], None],
) -> DiskLimits:
    directory.mkdir(parents=True)
    # Page-aligned buffers: O_DIRECT needs them, as kvtier's region rows are.
    source = mmap.mmap(-1, _HEADER + chunk)
    source[_HEADER:] = os.urandom(chunk)
    # Spread over subdirectories as the fs tier's files are: threads creating files in
    # one directory queue on its lock, and the reference would fall below the tiers.
    paths = [directory / f"{i % _SUBDIRECTORIES:02x}" / f"{i:06d}.raw" for i in range(count)]
    for path in {path.parent for path in paths}:
        path.mkdir()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (getattr(os, "O_DIRECT", 0) if direct else 0)

    def write(path: Path) -> None:
        fd = os.open(path, flags, 0o644)
        try:
            os.pwritev(fd, [memoryview(source)], 0)
        finally:
            os.close(fd)

    try:
        step(f"writing {count:,} chunk files")
        with ThreadPoolExecutor(threads) as pool:
            started = time.perf_counter()
            list(pool.map(write, paths))
            os.sync()
            write_s = time.perf_counter() - started
        step(f"reading {count:,} chunk files back cold")
        read_s = _read_cold(paths, _HEADER + chunk, threads, direct)
    finally:
        if not keep:
            shutil.rmtree(directory, ignore_errors=True)
        source.close()
    total = count * chunk
    return DiskLimits(total / write_s / 1e9, total / read_s / 1e9)


def _read_cold(paths: list[Path], file_bytes: int, threads: int, direct: bool) -> float:
    """Seconds to read ``paths`` (each at most ``file_bytes``) on ``threads`` threads,
    after evicting them from the page cache.

    Reads go as the fs tier's do: with O_DIRECT when it writes so, into page-aligned
    buffers that are already mapped (the region is prefaulted), one per thread.
    """
    read_flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    size = -(-file_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    buffers = threading.local()

    def read(path: Path) -> None:
        into = getattr(buffers, "into", None)
        if into is None:
            into = buffers.into = mmap.mmap(-1, size)
            into[:] = bytes(size)
        fd = os.open(path, read_flags)
        try:
            os.preadv(fd, [memoryview(into)], 0)
        finally:
            os.close(fd)

    drop_page_cache(paths)
    with ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        list(pool.map(read, paths))
        return time.perf_counter() - started


def measure_reads(
    paths: list[Path], *, depths: Iterable[int] = (4,), direct: bool = False
) -> float:
    """Best cold read bandwidth, GB/s, of the existing files ``paths`` (a tier's own,
    just written), by one thread and by each of ``depths`` threads.

    Files a run has just written may be served from a cache below the page cache (a
    virtual disk's host): read at the same moment and from the same place, they are
    the reference a tier reading them is held against.
    """
    if not paths:
        raise ValueError("measure_reads needs at least one file")
    sizes = [path.stat().st_size for path in paths]
    seconds = min(
        _read_cold(paths, max(sizes), threads, direct) for threads in sorted({1, *depths})
    )
    return sum(sizes) / seconds / 1e9


def measure_disk(
    directory: Path,
    count: int,
    chunk: int,
    *,
    depths: Iterable[int] = (4,),
    direct: bool = False,
    keep: bool = False,
    progress: Callable[[str], None] | None = None,
) -> DiskLimits:
    """Best raw write and cold read bandwidth of ``count`` one-chunk files in ``directory``,
    by one thread and by each of ``depths`` threads: the best the disk does at the
    depths a tier uses, so that the tier is held against no less.

    Each pass removes its files when it ends, unless ``keep``: then they stay under
    ``directory`` for the caller to remove once nothing is measured any more. On ext4
    without a journal (this project's VMs), creating a file costs CPU for every inode of
    its block group freed in the last minutes (the allocator checks each one's deletion
    time before passing over it): files removed between passes, or between the
    reference and a run, would slow the next one's file creations by the measurement's
    own doing, up to 0.6 ms of CPU per file here.

    ``progress`` hears each pass's steps as they start ("pass 2 of 3, 8 threads:
    writing 1,024 chunk files"): a pass of a gigabyte takes seconds to minutes.
    """
    counts = sorted({1, *depths})

    def step_of(number: int, threads: int) -> Callable[[str], None]:
        def step(text: str) -> None:
            if progress is not None:
                plural = "s" if threads > 1 else ""
                progress(f"pass {number} of {len(counts)}, {threads} thread{plural}: {text}")

        return step

    passes = [
        _one_pass(
            directory / f"raw-{threads}", count, chunk, threads, direct, keep, step_of(n, threads)
        )
        for n, threads in enumerate(counts, 1)
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


def measure_checksum(chunk: int, nbytes: int = 1 << 30, span: int = 512 << 20) -> float:
    """CPU seconds per GiB of the chunk checksum alone (:meth:`ChunkFormat.checksum
    <kvtier.format.ChunkFormat.checksum>`, every chunk's), over ``nbytes`` in chunks of
    ``chunk`` bytes.

    The chunks are taken in turn from a buffer of ``span`` bytes, larger than a CPU's
    caches, so that each is read from memory as a tier reads a chunk the engine wrote
    a while before: measured here, 0.19 ms per 2 MiB chunk so, against 0.05 ms for
    the same chunk hashed again from the cache. This is the cost of the one pass over
    the bytes that kvtier's fs tier adds to a plain file write.
    """
    count = max(1, span // chunk)
    buffer = mmap.mmap(-1, count * chunk)
    try:
        seed = os.urandom(chunk)
        for index in range(count):
            buffer[index * chunk : (index + 1) * chunk] = seed
        whole = memoryview(buffer)
        views = [whole[index * chunk : (index + 1) * chunk] for index in range(count)]
        per_gib = time_checksums(views, max(1, nbytes // chunk))
        for view in views:
            view.release()
        whole.release()
    finally:
        buffer.close()
    return per_gib


def time_checksums(views: Sequence[memoryview], rounds: int) -> float:
    """CPU seconds per GiB, in this thread, of ``rounds`` chunk checksums taken over
    ``views`` (chunks of one size) in turn, from the first again after the last."""
    checksum = ChunkFormat.checksum
    started = time.thread_time()
    for index in range(rounds):
        checksum(views[index % len(views)])
    seconds = time.thread_time() - started
    return seconds / (rounds * len(views[0]) / (1 << 30))


def measure_loopback(count: int, chunk: int) -> float:
    """GB/s of ``count`` chunks sent over loopback TCP from one thread to another.

    The sender writes each chunk with ``sendall``, the receiver ``recv_into``s it into
    a page-aligned buffer: what a p2p promotion does at each end, with nothing else.
    """
    source = mmap.mmap(-1, chunk)
    source[:] = os.urandom(chunk)
    target = mmap.mmap(-1, chunk)
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def send() -> None:
            sock, _ = listener.accept()
            with sock:
                for _ in range(count):
                    sock.sendall(source)
                sock.recv(1)

        sender = threading.Thread(target=send, name="kvtier-loopback-send", daemon=True)
        sender.start()
        with socket.create_connection(listener.getsockname(), timeout=60) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            view = memoryview(target)
            started = time.perf_counter()
            for _ in range(count):
                recv_exactly(sock, view)
            elapsed = time.perf_counter() - started
            view.release()
            sock.sendall(b"k")
        sender.join(60)
    source.close()
    target.close()
    return count * chunk / elapsed / 1e9


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from a blocking ``sock``; ConnectionError if the sender hangs up."""
    got, size = 0, len(view)
    while got < size:
        received = sock.recv_into(view[got:])
        if received == 0:
            raise ConnectionError("the sender hung up")
        got += received
