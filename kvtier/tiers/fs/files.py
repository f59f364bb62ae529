"""The fs tier's chunk files on disk: listing a namespace directory, probing O_DIRECT
and reading a chunk file back, verified. Every function here blocks: the tier calls
them on threads, never on the event loop. (Writing a file stays with the tier, whose
write syscall is a seam for tests.)
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from pathlib import Path

from kvtier.format import HEADER_BYTES, MISSING, TEMP_SUFFIX, ChunkFormat, key_of, temp_name
from kvtier.keys import OffloadKey
from kvtier.tiers._fileio import aligned_header, read_all

__all__ = [
    "MTIME_REFRESH_S",
    "O_DIRECT",
    "STALE_TMP_S",
    "list_chunk_files",
    "o_direct_works",
    "read_chunk_file",
]

#: ``os.O_DIRECT`` where the platform has it, else 0.
O_DIRECT: int = getattr(os, "O_DIRECT", 0)
# Temporary files older than this belong to writers that died; younger ones may be live.
STALE_TMP_S = 3600.0
# A load refreshes its file's modification time (what orders eviction after a restart)
# only when it is older than this: the refresh is a metadata write, journaled, on every
# promotion otherwise, and an order to the minute is all a restart needs.
MTIME_REFRESH_S = 60.0


def list_chunk_files(directory: Path) -> list[tuple[OffloadKey, int, float]]:
    """``(key, size, modification time)`` of every chunk file under ``directory``;
    temporary files older than :data:`STALE_TMP_S` (left by writers that died) are
    removed on the way."""
    found: list[tuple[OffloadKey, int, float]] = []
    now = time.time()
    with os.scandir(directory) as top:
        subdirs = [entry.path for entry in top if entry.is_dir(follow_symlinks=False)]
    for subdir in subdirs:
        with os.scandir(subdir) as entries:
            for entry in entries:
                name = entry.name
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if name.endswith(TEMP_SUFFIX):
                    if now - st.st_mtime > STALE_TMP_S:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                    continue
                key = key_of(name)
                if key is not None:
                    found.append((key, st.st_size, st.st_mtime))
    return found


def o_direct_works(directory: Path) -> bool:
    """Whether the filesystem of ``directory`` takes an O_DIRECT write of a page."""
    if not O_DIRECT:
        return False
    probe = directory / temp_name(".o_direct_probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        page = mmap.mmap(-1, HEADER_BYTES)
        try:
            os.pwrite(fd, page, 0)
        finally:
            page.close()
    except OSError:
        return False
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return True


def read_chunk_file(
    path: str, key: OffloadKey, row: memoryview, chunk_format: ChunkFormat, direct: bool
) -> str | None:
    """Read and verify ``key``'s chunk file at ``path`` into ``row``: None, ``MISSING``,
    or what was wrong (the bytes in ``row`` may then be anything)."""
    expected = HEADER_BYTES + len(row)
    try:
        stat, got, header = _read_into(path, row, expected, direct)
    except FileNotFoundError:
        return MISSING
    if got < expected or stat.st_size != expected:
        problem: str | None = "truncated file" if got < expected else "trailing bytes"
    else:
        problem = chunk_format.verify(memoryview(header), key, row)
    if problem is None and time.time() - stat.st_mtime > MTIME_REFRESH_S:
        # Loads refresh the modification time: it orders eviction after a restart.
        with contextlib.suppress(OSError):
            os.utime(path)
    return problem


def _read_into(
    path: str, row: memoryview, expected: int, direct: bool
) -> tuple[os.stat_result, int, mmap.mmap | bytearray]:
    """Read a chunk file's header and payload (into ``row``); its status, the bytes
    read and the header.

    With ``direct`` the bytes go from the device straight into the region's slot,
    past the page cache: measured on the project's VM disk, cold O_DIRECT reads at
    depth 4 ran at 0.47 GB/s against 0.22 GB/s buffered, and 1.4 against 0.85 GB/s
    at depth 16, at a fraction of the CPU (no page-cache copy). The slot is
    page-aligned and the header page too, as O_DIRECT requires.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    header = aligned_header() if direct else bytearray(HEADER_BYTES)
    try:
        stat = os.fstat(fd)
        got = read_all(fd, [memoryview(header), row], expected)
    finally:
        os.close(fd)
    return stat, got, header
