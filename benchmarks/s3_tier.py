"""S3 tier throughput against raw aiobotocore on the same server, same run.

The benchmark starts its own S3 server, ``rclone serve s3`` over a local directory (or
its in-memory backend with ``--memory``), and in each round moves ``--total-mib`` each
way, measuring:

1. cascade: chunks stored into the primary tier cascade to the s3 tier in jobs of
   ``--job-chunks``; the clock runs until every object is uploaded;
2. promotion: with the primary tier emptied, requests of ``--job-chunks`` chunks look
   their chunks up and wait until they are readable in the primary tier,
   ``--in-flight`` requests at once. Twice: with the lookups answered by the tier's
   cache (it saw the uploads; the data path alone, as the fs tier's index answers its
   lookups), then with the cache emptied (a HEAD per chunk first: ``read_cold_*``);
3. raw: the same number of objects of the same size PUT from one ``bytes`` and read
   back with GET + ``read()``, through a client with the tier's own configuration
   (pool, time-outs, checksums, signing) and the tier's concurrency.

Every round writes new objects and none is deleted until the end (rclone removes a
directory emptied by deletes while new uploads may be entering it), so the server
holds ``2 * rounds * total-mib`` MiB at the end: on disk, or in its memory with
``--memory``.

The servers measured here are CPU-bound on the same two cores as the client, so the
figures are ratios within one round, and the report takes the median of each round's
ratio. An event-loop probe measures how late its 1 ms timers fire while the tier
works. The last line is one JSON object with the figures.

    python benchmarks/s3_tier.py [--memory] [--total-mib 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from common import LagProbe, cascade, fill_rows, percentile, promote

from kvtier import (
    OffloadingConfig,
    OffloadingSpecFactory,
    TieringOffloadingManager,
    make_offload_key,
)
from kvtier.bench.servers import ACCESS_KEY, SECRET_KEY, RcloneS3Server, create_bucket
from kvtier.format import HEADER_BYTES
from kvtier.tiers.s3 import S3Tier

MIB = 1 << 20
BUCKET = "kvtier-bench"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=None, help="directory for the server's data")
    parser.add_argument("--memory", action="store_true", help="rclone's in-memory backend")
    parser.add_argument("--total-mib", type=int, default=512, help="MiB each way, per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--primary-mib", type=int, default=256)
    parser.add_argument("--job-chunks", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=4, help="promotion requests at once")
    parser.add_argument("--max-concurrency", type=int, default=16, help="the tier's requests")
    return parser.parse_args()


async def open_manager(args: argparse.Namespace, endpoint: str) -> TieringOffloadingManager:
    config = OffloadingConfig(
        engine_id=f"bench-s3-{uuid.uuid4().hex[:8]}",
        kv_bytes_per_block=int(args.chunk_mib * MIB),
        model_name="bench",
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": args.primary_mib * MIB,
            "secondary_tiers": [
                {
                    "type": "s3",
                    "bucket": BUCKET,
                    "endpoint_url": endpoint,
                    "access_key_id": ACCESS_KEY,
                    "secret_access_key": SECRET_KEY,
                    "prefix": "tier",
                    "max_concurrency": args.max_concurrency,
                    # Long enough that no answer expires during a round; the cold
                    # pass empties the cache itself.
                    "lookup_cache_ttl_s": 3600,
                }
            ],
        },
    )
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    await manager.start()
    fill_rows(manager)
    return manager


async def raw_round(
    client: Any, payload: bytes, count: int, concurrency: int, prefix: str
) -> tuple[float, float]:
    """GB/s of ``count`` PUTs of ``payload`` and of GETs of them back, ``concurrency`` at once."""
    gate = asyncio.Semaphore(concurrency)

    async def put(i: int) -> None:
        async with gate:
            await client.put_object(Bucket=BUCKET, Key=f"{prefix}/{i:06d}.raw", Body=payload)

    async def get(i: int) -> None:
        async with gate:
            response = await client.get_object(Bucket=BUCKET, Key=f"{prefix}/{i:06d}.raw")
            async with response["Body"] as body:
                if len(await body.read()) != len(payload):
                    raise RuntimeError("short read")

    started = time.perf_counter()
    await asyncio.gather(*(put(i) for i in range(count)))
    write_s = time.perf_counter() - started
    started = time.perf_counter()
    await asyncio.gather(*(get(i) for i in range(count)))
    read_s = time.perf_counter() - started
    total = count * (len(payload) - HEADER_BYTES)  # the same payload bytes as the tier
    return total / write_s / 1e9, total / read_s / 1e9


async def s3_rounds(args: argparse.Namespace, endpoint: str) -> dict[str, float]:
    manager = await open_manager(args, endpoint)
    try:
        return await measure(args, endpoint, manager)
    finally:
        await manager.aclose()


async def measure(
    args: argparse.Namespace, endpoint: str, manager: TieringOffloadingManager
) -> dict[str, float]:
    tier = manager.tiers[0]
    assert isinstance(tier, S3Tier)
    chunk = manager.region.chunk_bytes if manager.region is not None else 0
    count = args.total_mib * MIB // chunk
    payload = os.urandom(HEADER_BYTES + chunk)
    probe = LagProbe()
    probe.phase = None
    probe.start()
    rounds: list[dict[str, float]] = []
    latencies: list[float] = []
    try:
        async with tier.open_client() as client:
            # rclone races when concurrent first uploads create one directory (some
            # fail with 500); one small object per directory, first, avoids that.
            for directory in [tier.directory, *(f"raw{i}" for i in range(args.rounds))]:
                await client.put_object(Bucket=BUCKET, Key=f"{directory}/warm-up", Body=b"")
            for round_index in range(args.rounds):
                keys = [make_offload_key(f"{round_index}:{i}".encode()) for i in range(count)]
                probe.phase = "tier"
                write_s = await cascade(manager, keys, args.job_chunks)
                await manager.areset_cache()
                read_s, job_latencies = await promote(
                    manager, keys, args.job_chunks, args.in_flight
                )
                latencies += job_latencies
                await manager.areset_cache()
                tier.forget_answers()
                cold_s, _ = await promote(manager, keys, args.job_chunks, args.in_flight)
                probe.phase = None
                await manager.areset_cache()
                probe.phase = "raw"
                raw_write, raw_read = await raw_round(
                    client, payload, count, tier.settings.max_concurrency, f"raw{round_index}"
                )
                probe.phase = None
                measured = {
                    "write_gbps": count * chunk / write_s / 1e9,
                    "read_gbps": count * chunk / read_s / 1e9,
                    "read_cold_gbps": count * chunk / cold_s / 1e9,
                    "raw_write_gbps": raw_write,
                    "raw_read_gbps": raw_read,
                }
                measured["write_ratio"] = measured["write_gbps"] / measured["raw_write_gbps"]
                measured["read_ratio"] = measured["read_gbps"] / measured["raw_read_gbps"]
                measured["read_cold_ratio"] = measured["read_cold_gbps"] / measured["raw_read_gbps"]
                rounds.append(measured)
    finally:
        await probe.stop()
    manager.on_schedule_end()
    stats = manager.diagnostics.tier_stats()[tier.ctx.tier_name]
    retries = manager.metrics.sample("kvtier_s3_retries_total", {"tier": tier.ctx.tier_name})
    figures = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    figures.update(
        {
            "rounds": float(args.rounds),
            "chunks_per_round": float(count),
            "chunk_bytes": float(chunk),
            "max_concurrency": float(tier.settings.max_concurrency),
            "promotion_p50_ms": percentile(latencies, 0.5) * 1e3,
            "promotion_p99_ms": percentile(latencies, 0.99) * 1e3,
            "loop_lag_p50_ms": percentile(probe.by_phase.get("tier", []), 0.5) * 1e3,
            "loop_lag_p99_ms": percentile(probe.by_phase.get("tier", []), 0.99) * 1e3,
            "raw_loop_lag_p50_ms": percentile(probe.by_phase.get("raw", []), 0.5) * 1e3,
            "raw_loop_lag_p99_ms": percentile(probe.by_phase.get("raw", []), 0.99) * 1e3,
            "integrity_failures": stats["integrity_failures"],
            "job_failures": stats["promotion_failures"] + stats["cascade_failures"],
            "retries": retries or 0.0,
        }
    )
    return figures


def report(args: argparse.Namespace, figures: dict[str, float], server: str) -> None:
    total = figures["chunks_per_round"] * figures["chunk_bytes"] / MIB
    print(
        f"s3 tier on {server}: {args.rounds} rounds of {total:.0f} MiB each way, "
        f"{figures['chunk_bytes'] / MIB:g} MiB chunks, {figures['max_concurrency']:g} "
        "requests in flight (medians of rounds)"
    )
    rows = (
        ("cascade", "write", "PUT", "write"),
        ("promotion", "read", "GET", "read"),
        ("+ HEAD each", "read_cold", "GET", "read"),
    )
    for label, name, raw, baseline in rows:
        print(
            f"  {label:12s} {figures[f'{name}_gbps']:6.3f} GB/s   raw {raw} "
            f"{figures[f'raw_{baseline}_gbps']:6.3f} GB/s   ratio {figures[f'{name}_ratio']:.2f}"
        )
    print(
        f"  promotion latency ({args.job_chunks}-chunk requests) p50 "
        f"{figures['promotion_p50_ms']:.0f} ms, p99 {figures['promotion_p99_ms']:.0f} ms"
    )
    print(
        f"  loop lag p50 {figures['loop_lag_p50_ms']:.2f} ms, p99 "
        f"{figures['loop_lag_p99_ms']:.2f} ms   (raw client: p50 "
        f"{figures['raw_loop_lag_p50_ms']:.2f} ms, p99 {figures['raw_loop_lag_p99_ms']:.2f} ms)"
    )
    print(
        f"  job failures {figures['job_failures']:g}, retries {figures['retries']:g}, "
        f"integrity failures {figures['integrity_failures']:g}"
    )
    print(json.dumps({name: round(value, 4) for name, value in figures.items()}))


def main() -> None:
    args = parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-s3-bench-", dir=args.root))
    data = workdir / "data"
    (data / BUCKET).mkdir(parents=True)
    log = workdir / "rclone.log"
    server = RcloneS3Server(":memory:" if args.memory else data, log=log)
    try:
        server.start()
        if args.memory:
            asyncio.run(create_bucket(server.endpoint, BUCKET))
        figures = asyncio.run(s3_rounds(args, server.endpoint))
    except BaseException:
        # The server's own account of a failure is the first thing to read.
        server.stop()
        with contextlib.suppress(OSError):
            sys.stderr.write("rclone log (last lines):\n" + log.read_text()[-4000:])
        raise
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    report(args, figures, "rclone serve s3 (" + ("memory" if args.memory else "disk") + ")")


if __name__ == "__main__":
    main()
