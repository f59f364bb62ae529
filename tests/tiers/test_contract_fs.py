"""The tier contract, run against the fs tier: two engines sharing one ``root_dir``.

Stalls are real I/O held in the tier's own threads:

- a load: the test holds a write lease (``F_SETLEASE``) on the chunk's file, so the
  tier's ``open()`` blocks in the kernel until the lease is dropped; the read then
  goes on into the slot it was given;
- a store: no unprivileged process can block a write to a new file, so the next call
  of the tier's write syscall (``FileSystemTier._pwritev``, the seam its fault tests
  use) waits in the I/O thread before writing the chunk, then writes it late.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from kvtier import KVTier
from kvtier.format import HEADER_BYTES
from kvtier.keys import OffloadKey
from kvtier.testing import Stall, TierContract
from kvtier.tiers.fs import FileSystemTier

# A held write gives up after this long, so that a test that never lets it go cannot
# leave a thread behind forever.
HOLD_LIMIT_S = 60.0


def fs_tier(node: KVTier) -> FileSystemTier:
    tier = node.manager.tiers[0]
    assert isinstance(tier, FileSystemTier)
    return tier


class LeaseStall(Stall):
    """A write lease on a chunk file: whoever opens it blocks until it is dropped.

    The kernel reports a blocked opener by starting to break the lease, which
    ``F_GETLEASE`` shows; a read that went through refreshes the file's modification
    time (the fs tier's recency mark, refreshed when older than a minute: the stall
    makes it older first), or removes the file if it failed verification.
    """

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        os.utime(path, (0, 0))
        self.mtime = path.stat().st_mtime_ns
        self._was_reached = False
        self._released = False
        self.fd = os.open(path, os.O_RDONLY)
        try:
            # The break notice would be SIGIO, which ends the process; SIGURG is
            # ignored unless a handler asks for it.
            fcntl.fcntl(self.fd, fcntl.F_SETSIG, signal.SIGURG)
            fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as exc:
            os.close(self.fd)
            pytest.skip(f"the filesystem of {path} refuses file leases: {exc}")

    def release(self) -> None:
        if not self._released:
            self._released = True
            fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            os.close(self.fd)

    def _breaking(self) -> bool:
        return not self._released and fcntl.fcntl(self.fd, fcntl.F_GETLEASE) != fcntl.F_WRLCK

    def reached(self) -> bool:
        self._was_reached = self._was_reached or self._breaking()
        return self._was_reached

    def holding(self) -> bool:
        return self._breaking()

    def finished(self) -> bool:
        try:
            return self.path.stat().st_mtime_ns != self.mtime
        except FileNotFoundError:
            return True


class TestFsContract(TierContract):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path / "fs"

    async def tier_config(self) -> Mapping[str, Any]:
        return {"type": "fs", "root_dir": str(self.root)}

    async def reader_tier_config(self, writer: KVTier) -> Mapping[str, Any]:
        return {"type": "fs", "root_dir": str(self.root)}

    async def corrupt(self, writer: KVTier, key: OffloadKey) -> None:
        path = fs_tier(writer).path_of(key)
        data = bytearray(path.read_bytes())
        data[HEADER_BYTES + 100] ^= 0x01
        path.write_bytes(bytes(data))

    async def truncate(self, writer: KVTier, key: OffloadKey) -> None:
        path = fs_tier(writer).path_of(key)
        os.truncate(path, path.stat().st_size - 1000)

    async def stored_chunk(self, writer: KVTier, key: OffloadKey) -> bytes | None:
        path = fs_tier(writer).path_of(key)
        return path.read_bytes()[HEADER_BYTES:] if path.exists() else None

    def capacity_config(self, chunks: int, chunk_bytes: int) -> Mapping[str, Any]:
        return {"capacity_bytes": chunks * (HEADER_BYTES + chunk_bytes)}

    @contextlib.asynccontextmanager
    async def stall_loads(self, node: KVTier, key: OffloadKey) -> AsyncIterator[Stall]:
        stall = LeaseStall(fs_tier(node).path_of(key))
        try:
            yield stall
        finally:
            stall.release()

    @contextlib.asynccontextmanager
    async def stall_stores(self, node: KVTier) -> AsyncIterator[Stall]:
        tier = fs_tier(node)
        stall = Stall()
        release = threading.Event()
        held = threading.Lock()
        write = tier._pwritev

        def held_write(fd: int, buffers: list[memoryview], offset: int) -> int:
            if not held.acquire(blocking=False):
                return write(fd, buffers, offset)
            stall.reach()
            release.wait(HOLD_LIMIT_S)
            try:
                return write(fd, buffers, offset)
            finally:
                stall.finish()

        tier._pwritev = held_write  # this engine's tier only
        try:
            yield stall
        finally:
            release.set()
