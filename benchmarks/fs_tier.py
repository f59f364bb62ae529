"""Filesystem tier throughput against raw positional I/O of the same bytes, same run.

Each round moves ``--total-gib`` each way, and measures, on the same disk:

1. cascade: chunks stored into the primary tier cascade to the fs tier; the clock runs
   until every file is written and ``os.sync()`` has returned;
2. promotion: with the primary tier emptied and the page cache dropped, requests of
   ``--job-chunks`` chunks look their chunks up and wait until they are readable in the
   primary tier (each request is one promotion job, ``--in-flight`` at once);
3. raw: the same number of files of the same size written with ``os.pwritev`` (with
   O_DIRECT when the tier uses it), synced, the cache dropped, and read back with
   ``os.preadv``, by one thread and by the tier's depth; the better is the limit.

A virtual disk's speed drifts by tens of percent from one second to the next, so the
rounds interleave tier and raw passes and the report takes the median of each round's
ratio. An event-loop probe measures how late its 1 ms timers fire throughout. Then the
scheduler overhead: ``lookup`` hits and one-chunk ``prepare_store`` + ``complete_store``
cycles of a manager with no secondary tier.

The last line is one JSON object with the figures; BENCHMARKS.md records them.

    python benchmarks/fs_tier.py --root /path/on/the/disk/to/measure
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvtier import (
    LookupResult,
    OffloadingConfig,
    OffloadingSpecFactory,
    ReqContext,
    TieringOffloadingManager,
    make_offload_key,
)
from kvtier.tiers.fs import FileSystemTier

MIB = 1 << 20
HEADER = 4096


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=None, help="directory on the disk to test")
    parser.add_argument("--total-gib", type=float, default=2.0, help="GiB each way, per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--primary-mib", type=int, default=512)
    parser.add_argument("--job-chunks", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=2, help="promotion jobs at once")
    parser.add_argument("--o-direct", choices=("auto", "true", "false"), default="auto")
    parser.add_argument("--read-depth", type=int, default=None)
    parser.add_argument("--write-depth", type=int, default=None)
    parser.add_argument("--lookups", type=int, default=2_000_000)
    parser.add_argument("--store-cycles", type=int, default=300_000)
    return parser.parse_args()


class LagProbe:
    """How late a 1 ms timer fires: the event loop's responsiveness."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            start = loop.time()
            await asyncio.sleep(0.001)
            self.lags.append(loop.time() - start - 0.001)


def percentile(values: list[float], share: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def drop_cache(files: list[Path]) -> None:
    """Evict the files from the page cache (they are clean after a sync)."""
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    for path in files:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


async def open_manager(args: argparse.Namespace, root: Path) -> TieringOffloadingManager:
    tier: dict[str, object] = {
        "type": "fs",
        "root_dir": str(root),
        "shared": False,
        "o_direct": {"auto": "auto", "true": True, "false": False}[args.o_direct],
    }
    if args.read_depth:
        tier["read_depth"] = args.read_depth
    if args.write_depth:
        tier["write_depth"] = args.write_depth
    config = OffloadingConfig(
        engine_id=f"bench-fs-{uuid.uuid4().hex[:8]}",
        kv_bytes_per_block=int(args.chunk_mib * MIB),
        model_name="bench",
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": args.primary_mib * MIB,
            "secondary_tiers": [tier],
        },
    )
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    await manager.start()
    rows = manager.region.primary_view if manager.region is not None else []
    # Distinct, incompressible bytes in every slot, written once before any timing.
    seed = os.urandom(rows.row_bytes if rows else 0)
    for slot in range(len(rows)):
        rows[slot][:] = seed[slot % 4096 :] + seed[: slot % 4096]
    return manager


async def cascade(manager: TieringOffloadingManager, keys: list, job: int) -> float:
    """Seconds to cascade ``keys`` to the fs tier and sync them to disk."""
    started = time.perf_counter()
    for first in range(0, len(keys), job):
        batch, req = keys[first : first + job], ReqContext(f"w{first}")
        while (out := manager.prepare_store(batch, req)) is None:
            manager.on_schedule_end()
            await manager.wait_for_completions()
        manager.complete_store(out.keys_to_store, req)
        manager.on_request_finished(req)
    await manager.drain()
    await asyncio.to_thread(os.sync)
    return time.perf_counter() - started


async def promote(
    manager: TieringOffloadingManager, keys: list, job: int, in_flight: int
) -> tuple[float, list[float]]:
    """Seconds to promote ``keys`` back, and each job's submit-to-ready latency."""
    latencies: list[float] = []
    gate = asyncio.Semaphore(in_flight)

    async def one(first: int) -> None:
        async with gate:
            batch, req = keys[first : first + job], ReqContext(f"r{first}")
            submitted = time.perf_counter()
            # Every key is looked up each time (no short-circuit): the first lookups of a
            # step queue the whole batch, which then goes to the tier as one job.
            while [manager.lookup(k, req) for k in batch].count(LookupResult.HIT) < len(batch):
                manager.on_schedule_end()
                await manager.wait_for_completions()
            latencies.append(time.perf_counter() - submitted)
            manager.on_request_finished(req)

    started = time.perf_counter()
    await asyncio.gather(*(one(first) for first in range(0, len(keys), job)))
    return time.perf_counter() - started, latencies


def unlink_all(paths: list[Path]) -> None:
    for path in paths:
        path.unlink()


def raw_round(
    directory: Path, count: int, chunk: int, threads: int, direct: bool
) -> tuple[float, float]:
    """GB/s of pwritev (then sync) and cold preadv of ``count`` one-chunk files."""
    directory.mkdir()
    # Page-aligned buffers: O_DIRECT needs them, and the region's rows are too.
    source = mmap.mmap(-1, HEADER + chunk)
    source[HEADER:] = os.urandom(chunk)
    paths = [directory / f"{i:06d}.raw" for i in range(count)]
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)

    def write(path: Path) -> None:
        fd = os.open(path, flags, 0o644)
        try:
            os.pwritev(fd, [memoryview(source)], 0)
        finally:
            os.close(fd)

    def read(path: Path) -> None:
        into = bytearray(HEADER + chunk)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [memoryview(into)], 0)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        list(pool.map(write, paths))
        os.sync()
        write_s = time.perf_counter() - started
        drop_cache(paths)
        started = time.perf_counter()
        list(pool.map(read, paths))
        read_s = time.perf_counter() - started
    shutil.rmtree(directory)
    source.close()
    total = count * chunk
    return total / write_s / 1e9, total / read_s / 1e9


async def fs_rounds(args: argparse.Namespace, root: Path) -> dict[str, float]:
    manager = await open_manager(args, root / "tier")
    tier = manager.tiers[0]
    assert isinstance(tier, FileSystemTier)
    chunk = manager.region.chunk_bytes if manager.region is not None else 0
    count = int(args.total_gib * (1 << 30)) // chunk
    probe = LagProbe()
    probe.start()
    rounds: list[dict[str, float]] = []
    latencies: list[float] = []
    for round_index in range(args.rounds):
        keys = [make_offload_key(f"{round_index}:{i}".encode()) for i in range(count)]
        write_s = await cascade(manager, keys, args.job_chunks)
        files = [tier.path_of(key) for key in keys]
        await manager.areset_cache()
        await asyncio.to_thread(drop_cache, files)
        read_s, job_latencies = await promote(manager, keys, args.job_chunks, args.in_flight)
        latencies += job_latencies
        await manager.areset_cache()
        await asyncio.to_thread(unlink_all, files)
        raw = [
            await asyncio.to_thread(
                raw_round,
                root / f"raw{round_index}-{threads}",
                count,
                chunk,
                threads,
                tier.o_direct,
            )
            for threads in sorted({1, max(tier.read_depth, tier.write_depth)})
        ]
        measured = {
            "write_gbps": count * chunk / write_s / 1e9,
            "read_gbps": count * chunk / read_s / 1e9,
            "raw_write_gbps": max(write for write, _ in raw),
            "raw_read_gbps": max(read for _, read in raw),
        }
        measured["write_ratio"] = measured["write_gbps"] / measured["raw_write_gbps"]
        measured["read_ratio"] = measured["read_gbps"] / measured["raw_read_gbps"]
        rounds.append(measured)
    await probe.stop()
    manager.on_schedule_end()
    integrity = manager.tier_stats()["1:fs"]["integrity_failures"]
    await manager.aclose()
    figures = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    figures.update(
        {
            "rounds": float(args.rounds),
            "chunks_per_round": float(count),
            "chunk_bytes": float(chunk),
            "promotion_p50_ms": percentile(latencies, 0.5) * 1e3,
            "promotion_p99_ms": percentile(latencies, 0.99) * 1e3,
            "loop_lag_p50_ms": percentile(probe.lags, 0.5) * 1e3,
            "loop_lag_p99_ms": percentile(probe.lags, 0.99) * 1e3,
            "integrity_failures": integrity,
            "o_direct": float(tier.o_direct),
            "read_depth": float(tier.read_depth),
            "write_depth": float(tier.write_depth),
        }
    )
    return figures


def scheduler_phase(args: argparse.Namespace) -> dict[str, float]:
    """Manager calls with no secondary tier: lookup hits and store cycles."""
    stored = 100_000
    config = OffloadingConfig(
        engine_id=f"bench-sched-{uuid.uuid4().hex[:8]}",
        kv_bytes_per_block=4096,
        extra_config={"cpu_bytes_to_use": 4096 * stored},
    )
    spec = OffloadingSpecFactory.create_spec(config)
    manager = spec.get_manager()
    req = ReqContext("bench")
    keys = [make_offload_key(i.to_bytes(32, "big")) for i in range(stored)]
    for first in range(0, stored, 1000):
        batch = keys[first : first + 1000]
        manager.prepare_store(batch, req)
        manager.complete_store(batch, req)
    lookup = manager.lookup
    probe_keys = (keys * (args.lookups // stored + 1))[: args.lookups]
    started = time.perf_counter()
    for key in probe_keys:
        lookup(key, req)
    lookups_per_s = args.lookups / (time.perf_counter() - started)
    fresh = [[make_offload_key((stored + i).to_bytes(32, "big"))] for i in range(args.store_cycles)]
    prepare, complete = manager.prepare_store, manager.complete_store
    started = time.perf_counter()
    for one in fresh:  # the primary tier is full: every cycle also evicts
        prepare(one, req)
        complete(one, req)
    cycles_per_s = args.store_cycles / (time.perf_counter() - started)
    spec.shutdown()
    return {"lookups_per_s": lookups_per_s, "store_cycles_per_s": cycles_per_s}


def report(args: argparse.Namespace, figures: dict[str, float]) -> None:
    total = figures["chunks_per_round"] * figures["chunk_bytes"] / (1 << 30)
    mode = "O_DIRECT" if figures["o_direct"] else "buffered"
    print(
        f"fs tier: {args.rounds} rounds of {total:.1f} GiB each way, "
        f"{figures['chunk_bytes'] / MIB:g} MiB chunks, {mode} writes (medians of rounds)"
    )
    for name, raw in (("write", "pwritev"), ("read", "preadv")):
        label = "cascade  " if name == "write" else "promotion"
        print(
            f"  {label} {figures[f'{name}_gbps']:6.2f} GB/s   raw {raw} "
            f"{figures[f'raw_{name}_gbps']:6.2f} GB/s   ratio {figures[f'{name}_ratio']:.2f}"
        )
    print(
        f"  promotion latency ({args.job_chunks}-chunk jobs) p50 "
        f"{figures['promotion_p50_ms']:.1f} ms, p99 {figures['promotion_p99_ms']:.1f} ms"
    )
    lag_p50, lag_p99 = figures["loop_lag_p50_ms"], figures["loop_lag_p99_ms"]
    print(f"  loop lag p50 {lag_p50:.2f} ms, p99 {lag_p99:.2f} ms")
    print(
        f"  scheduler: {figures['lookups_per_s'] / 1e6:.2f} M lookups/s, "
        f"{figures['store_cycles_per_s'] / 1e3:.0f} k store cycles/s"
    )
    print(json.dumps({name: round(value, 4) for name, value in figures.items()}))


def main() -> None:
    args = parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.root))
    try:
        figures = asyncio.run(fs_rounds(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures.update(scheduler_phase(args))
    report(args, figures)


if __name__ == "__main__":
    main()
