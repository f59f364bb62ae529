"""The fs tier's adaptive write depth against fixed depths, when files cost CPU to create.

On ext4 without a journal, a file created soon after many were removed nearby costs
CPU for each of them (the allocator checks every recently freed inode of the block
group); on a busy host, every file's creation waits for a core. Either way each store
costs more than its bytes, and more files in flight hide it. This benchmark provokes
exactly that and asks whether the adaptive depth finds the device's rate: its stores
within 10% of the best fixed depth measured in the same run.

Each round stores ``--gib`` of distinct chunks through a manager with one fs tier, at
each of ``--depths`` (``auto``: kvtier's default, adaptive; a number: ``write_depth``
fixed), in an order that rotates from round to round, each in a fresh directory. The
clock runs from the first store until every file is written and ``os.sync()`` returned
(``common.cascade``). Before each store, the condition:

* ``--removals N``: N chunk-sized files written into the tier's own namespace
  directory, synced and removed (0: none). The default, as many as the store writes,
  is what a run that follows another's cleanup meets.
* ``--cpu-burners K``: K processes spinning in Python on the machine's cores while
  the store runs (0: none).

Every store's files stay until the end, so no pass removes files before another but
the condition's own. The depth the adaptive tier ran at is sampled every 0.1 s.

The last line is one JSON object: ``gbps`` (each depth's median GB/s), ``best_fixed``,
``adaptive_over_best`` (the adaptive median over the best fixed median), ``traces``.

    python benchmarks/fs_depth.py --root /path/on/the/disk --cpu-burners 2
    python benchmarks/fs_depth.py --quick      # a few seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import common
from common import cascade, fill_rows

from kvtier import OffloadingConfig, OffloadingSpecFactory, make_offload_key
from kvtier.tiers.fs import FileSystemTier

#: How often the adaptive depth is sampled.
SAMPLE_S = 0.1
#: A burner: pure Python, until killed.
BURNER = "x = 0\nwhile True:\n    x += 1\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=None, help="directory on the disk to test")
    parser.add_argument("--gib", type=float, default=1.5, help="GiB each store writes")
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--job-chunks", type=int, default=16)
    parser.add_argument("--depths", default="auto,4,8,16,32", help="auto and fixed depths")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--removals",
        type=int,
        default=None,
        help="files written and removed in the tier's directory before each store "
        "(default: as many as the store writes; 0: none)",
    )
    parser.add_argument("--cpu-burners", type=int, default=0, help="spinning processes")
    parser.add_argument("--quick", action="store_true", help="small sizes, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.gib, args.chunk_mib, args.rounds, args.depths = 0.0625, 0.25, 1, "auto,4"
    args.depth_list = []
    for item in args.depths.split(","):
        if item != "auto" and not (item.isdigit() and int(item) >= 1):
            parser.error(f"--depths: {item!r} is neither auto nor a depth of at least 1")
        args.depth_list.append(item)
    if args.gib <= 0 or args.chunk_mib <= 0 or args.rounds < 1 or args.job_chunks < 1:
        parser.error("--gib, --chunk-mib, --rounds and --job-chunks must be positive")
    args.chunk_bytes = int(args.chunk_mib * common.MIB)
    args.count = max(args.job_chunks, int(args.gib * common.GIB) // args.chunk_bytes)
    if args.removals is None:
        args.removals = args.count
    return args


def remove_burst(directory: Path, count: int, chunk: int) -> None:
    """``count`` files of ``chunk`` bytes spread as the tier spreads its own, synced and
    removed: the condition a store meets after a cleanup nearby."""
    if count <= 0:
        return
    data = os.urandom(chunk)
    paths = [directory / f"{i % 256:02x}" / f"burst-{i}" for i in range(count)]
    for parent in {path.parent for path in paths}:
        parent.mkdir(parents=True, exist_ok=True)
    for path in paths:
        path.write_bytes(data)
    os.sync()
    for path in paths:
        path.unlink()


def start_burners(count: int) -> list[subprocess.Popen[bytes]]:
    """``count`` processes spinning in Python until killed."""
    return [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(count)]


async def store_once(args: argparse.Namespace, root: Path, depth: str) -> dict[str, Any]:
    tier: dict[str, Any] = {"type": "fs", "root_dir": str(root), "shared": False}
    if depth != "auto":
        tier["write_depth"] = int(depth)
    config = OffloadingConfig(
        engine_id=f"bench-depth-{uuid.uuid4().hex[:8]}",
        kv_bytes_per_block=args.chunk_bytes,
        model_name="bench",
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 32 * args.job_chunks * args.chunk_bytes,
            "secondary_tiers": [tier],
        },
    )
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    await manager.start()
    try:
        fill_rows(manager)
        fs = manager.tiers[0]
        assert isinstance(fs, FileSystemTier)
        remove_burst(fs.directory, args.removals, args.chunk_bytes)
        tag = uuid.uuid4().hex[:8]
        keys = [make_offload_key(f"{tag}:{i}".encode()) for i in range(args.count)]
        trace: list[int] = []

        async def sample() -> None:
            while True:
                trace.append(fs.write_depth)
                await asyncio.sleep(SAMPLE_S)

        burners = start_burners(args.cpu_burners)
        sampler = asyncio.ensure_future(sample())
        try:
            seconds = await cascade(manager, keys, args.job_chunks)
            started = time.perf_counter()
            await asyncio.to_thread(os.sync)
            seconds += time.perf_counter() - started
        finally:
            sampler.cancel()
            for burner in burners:
                burner.kill()
                burner.wait()
        failures = manager.diagnostics.tier_stats()["1:fs"]["integrity_failures"]
        return {
            "gbps": args.count * args.chunk_bytes / seconds / 1e9,
            "trace": trace,
            "integrity_failures": failures,
        }
    finally:
        await manager.aclose()


async def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    gbps: dict[str, list[float]] = {depth: [] for depth in args.depth_list}
    traces: list[list[int]] = []
    depths = list(args.depth_list)
    for round_index in range(args.rounds):
        shift = round_index % len(depths)
        for depth in depths[shift:] + depths[:shift]:  # the order rotates: drift falls on all
            result = await store_once(args, root / f"r{round_index}-d{depth}", depth)
            gbps[depth].append(result["gbps"])
            if depth == "auto":
                traces.append(result["trace"])
            gb_s = result["gbps"]
            print(f"  round {round_index + 1}, depth {depth}: {gb_s:.2f} GB/s", flush=True)
    medians = {depth: statistics.median(values) for depth, values in gbps.items()}
    fixed = {depth: value for depth, value in medians.items() if depth != "auto"}
    best = max(fixed, key=fixed.__getitem__) if fixed else None
    return {
        "gbps": medians,
        "runs": gbps,
        "best_fixed": best,
        "adaptive_over_best": (
            medians["auto"] / fixed[best] if best is not None and "auto" in medians else None
        ),
        "traces": traces,
        "removals": args.removals,
        "cpu_burners": args.cpu_burners,
        "chunks": args.count,
        "chunk_bytes": args.chunk_bytes,
        "rounds": args.rounds,
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    print(
        f"fs depth: {args.count} chunks of {args.chunk_mib:g} MiB a store, depths "
        f"{args.depths}, {args.rounds} round(s); before each store {args.removals} files "
        f"removed nearby, {args.cpu_burners} CPU burner(s) while it runs"
    )
    figures = common.run_in_scratch(lambda a, root: asyncio.run(run(a, root)), args, "fs_depth.py")
    for depth, value in figures["gbps"].items():
        print(f"  depth {depth:>4}: median {value:.2f} GB/s")
    if figures["adaptive_over_best"] is not None:
        print(
            f"  adaptive over the best fixed depth ({figures['best_fixed']}): "
            f"{figures['adaptive_over_best']:.2f}"
        )
    for trace in figures["traces"]:
        print(f"  adaptive depth every {SAMPLE_S:g} s: {trace}")
    print(json.dumps(common.rounded(figures)))


if __name__ == "__main__":
    main()
