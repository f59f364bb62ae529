"""The tiers ``kvtier bench`` knows, in :data:`BENCH_TIERS`: fs, s3 and p2p.

Each is held against the plain version of its own I/O, measured in the same run with
as many chunks as the tier moved: fs against raw ``pwritev``/``preadv`` of one-chunk
files (1 GiB at most; the best of one thread and the tier's own depths), p2p against
chunks sent over loopback TCP (1 GiB at most). The s3 tier's entry lives with the tier
(:mod:`kvtier.tiers.s3.bench`) and joins by one line below. Another tier type joins by
registering its own :class:`~kvtier.bench.registry.BenchTier` here.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeVar

from kvtier.bench.physical import measure_disk, measure_loopback
from kvtier.bench.registry import (
    BenchTier,
    BenchTierRegistry,
    Direction,
    Limit,
    LimitContext,
    LocalTier,
)
from kvtier.bench.services import peer_engine
from kvtier.bench.settings import BenchSettings
from kvtier.tiers import SecondaryTier
from kvtier.tiers.fs import FileSystemTier
from kvtier.tiers.p2p import PeerTier

__all__ = ["BENCH_TIERS", "FS", "P2P", "raw_disk_depths"]

_T = TypeVar("_T", bound=SecondaryTier)


def _as(tier: SecondaryTier, tier_class: type[_T]) -> _T:
    # The registry hands an entry only tiers of its tier_class.
    if not isinstance(tier, tier_class):
        raise TypeError(f"expected a {tier_class.__name__}, got {type(tier).__name__}")
    return tier


@contextlib.asynccontextmanager
async def _fs_directory(settings: BenchSettings, workspace: Path) -> AsyncIterator[LocalTier]:
    yield LocalTier({"type": "fs", "root_dir": str(workspace / "fs"), "shared": False})


def raw_disk_depths(fs: FileSystemTier) -> tuple[int, ...]:
    """The thread counts the raw disk limit is the best of: one, and the most the tier
    itself reads or writes at (a fixed ``read_depth`` / ``write_depth``, else
    ``max_read_depth`` / ``max_write_depth``)."""
    settings = fs.settings
    return tuple(sorted({1, settings.read_range.maximum, settings.write_range.maximum}))


async def _raw_disk(tier: SecondaryTier, run: LimitContext) -> dict[Direction, float]:
    fs = _as(tier, FileSystemTier)
    directory = run.workspace / "physical"
    try:
        # Every pass's files stay until the last pass ends: a pass creating its files
        # just after the one before removed its own pays for that removal on some
        # filesystems (see measure_disk).
        disk = await asyncio.to_thread(
            measure_disk,
            directory,
            run.chunks(run.traffic.bytes_written, 1 << 30),
            run.chunk_bytes,
            depths=raw_disk_depths(fs),
            direct=fs.o_direct,
            keep=True,
            progress=run.progress,
        )
    finally:
        await asyncio.to_thread(shutil.rmtree, directory, True)
    return {Direction.WRITE: disk.write_gbps, Direction.READ: disk.read_gbps}


def _page_cache(tier: SecondaryTier, direction: Direction) -> str | None:
    """The route around the raw limit an fs tier without O_DIRECT takes: the page cache."""
    fs = _as(tier, FileSystemTier)
    if fs.o_direct:
        return None  # the same I/O as the raw figure's, at the same depths
    if direction is Direction.WRITE:
        return (
            "the fs tier writes through the page cache (o_direct off, or not supported "
            "here): a cascade ends once its bytes are in memory, while the raw writes "
            "end with os.sync()"
        )
    return (
        "the fs tier reads through the page cache (o_direct off, or not supported here), "
        "which may still hold chunks this run wrote, while the raw reads are cold"
    )


FS = BenchTier(
    "fs",
    FileSystemTier,
    _fs_directory,
    _raw_disk,
    (
        Limit(Direction.WRITE, "disk write (raw pwritev)", "disk_write_gbps", "fs_write"),
        Limit(Direction.READ, "disk read (raw preadv)", "disk_read_gbps", "fs_read"),
    ),
    _page_cache,
)


@contextlib.asynccontextmanager
async def _peer(settings: BenchSettings, workspace: Path) -> AsyncIterator[LocalTier]:
    async with peer_engine(settings) as peer:

        def heard_of_peer_chunks(tier: SecondaryTier) -> bool:
            return _as(tier, PeerTier).indexed_keys >= peer.chunks

        yield LocalTier(
            {
                "type": "p2p",
                "listen": "127.0.0.1:0",
                "peers": [peer.address],
                "secret": peer.secret,
            },
            ready=heard_of_peer_chunks,
        )


async def _loopback_tcp(tier: SecondaryTier, run: LimitContext) -> dict[Direction, float]:
    gbps = await asyncio.to_thread(
        measure_loopback, run.chunks(run.traffic.bytes_read, 1 << 30), run.chunk_bytes
    )
    return {Direction.READ: gbps}


P2P = BenchTier(
    "p2p",
    PeerTier,
    _peer,
    _loopback_tcp,
    (Limit(Direction.READ, "loopback TCP", "tcp_loopback_gbps", "p2p_read"),),
)

#: The tiers ``kvtier bench --tiers`` can name, one line each, in the order of the
#: limits table; register a plugin tier's entry here.
BENCH_TIERS = BenchTierRegistry()
BENCH_TIERS.register(FS)
BENCH_TIERS.register_module("s3", "kvtier.tiers.s3.bench")
BENCH_TIERS.register(P2P)
