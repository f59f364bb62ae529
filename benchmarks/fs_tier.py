"""Filesystem tier throughput against raw positional I/O of the same bytes, same run.

Each round moves ``--total-gib`` each way, and measures, on the same disk:

1. cascade: chunks stored into the primary tier cascade to the fs tier; the clock runs
   until every file is written and ``os.sync()`` has returned;
2. promotion: with the primary tier emptied and the page cache dropped, requests of
   ``--job-chunks`` chunks look their chunks up and wait until they are readable in the
   primary tier (each request is one promotion job, ``--in-flight`` at once);
3. raw: the same number of files of the same size written with ``os.pwritev`` (with
   O_DIRECT when the tier uses it), synced, the cache dropped, and read back with
   ``os.preadv``, by one thread and by the tier's depth; the better is the limit
   (:mod:`kvtier.bench.physical`, which ``kvtier bench`` uses too).

A virtual disk's speed drifts by tens of percent from one second to the next, so the
rounds interleave tier and raw passes and the report takes the median of each round's
ratio. An event-loop probe measures how late its 1 ms timers fire throughout. Then the
scheduler overhead: ``lookup`` hits and one-chunk ``prepare_store`` + ``complete_store``
cycles of a manager with no secondary tier.

The last line is one JSON object with the figures; docs/benchmarks/fs-tier.md records them.

    python benchmarks/fs_tier.py --root /path/on/the/disk/to/measure
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from common import LagProbe, cascade, fill_rows, percentile, promote
from scheduler import measure_scheduler

from kvtier import (
    OffloadingConfig,
    OffloadingSpecFactory,
    TieringOffloadingManager,
    make_offload_key,
)
from kvtier.bench.physical import drop_page_cache, measure_disk
from kvtier.bench.tiers import raw_disk_depths
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
    fill_rows(manager)
    return manager


async def cascade_synced(manager: TieringOffloadingManager, keys: list, job: int) -> float:
    """Seconds to cascade ``keys`` to the fs tier and sync them to disk."""
    started = time.perf_counter()
    await cascade(manager, keys, job)
    await asyncio.to_thread(os.sync)
    return time.perf_counter() - started


def unlink_all(paths: list[Path]) -> None:
    for path in paths:
        path.unlink()


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
        write_s = await cascade_synced(manager, keys, args.job_chunks)
        files = [tier.path_of(key) for key in keys]
        await manager.areset_cache()
        await asyncio.to_thread(drop_page_cache, files)
        read_s, job_latencies = await promote(manager, keys, args.job_chunks, args.in_flight)
        latencies += job_latencies
        await manager.areset_cache()
        await asyncio.to_thread(unlink_all, files)
        raw = await asyncio.to_thread(
            measure_disk,
            root / f"raw{round_index}",
            count,
            chunk,
            depths=raw_disk_depths(tier),
            direct=tier.o_direct,
        )
        measured = {
            "write_gbps": count * chunk / write_s / 1e9,
            "read_gbps": count * chunk / read_s / 1e9,
            "raw_write_gbps": raw.write_gbps,
            "raw_read_gbps": raw.read_gbps,
        }
        measured["write_ratio"] = measured["write_gbps"] / measured["raw_write_gbps"]
        measured["read_ratio"] = measured["read_gbps"] / measured["raw_read_gbps"]
        rounds.append(measured)
    await probe.stop()
    manager.on_schedule_end()
    integrity = manager.diagnostics.tier_stats()["1:fs"]["integrity_failures"]
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
            # Fixed, or where the adaptive depth ended.
            "read_depth": float(tier.read_depth),
            "write_depth": float(tier.write_depth),
        }
    )
    return figures


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
    figures.update(measure_scheduler(args.lookups, args.store_cycles))
    report(args, figures)


if __name__ == "__main__":
    main()
