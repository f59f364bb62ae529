"""What the tier benchmarks share: filling the primary tier, cascading, promoting.

The benchmarks drive a ``TieringOffloadingManager`` the way a scheduler does: stores in
jobs of a few chunks, promotions as requests that look their chunks up step after step
until every one is a hit.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence

from kvtier import LookupResult, ReqContext, TieringOffloadingManager
from kvtier.bench.probe import LagProbe, percentile
from kvtier.keys import OffloadKey

__all__ = ["LagProbe", "cascade", "fill_rows", "percentile", "promote"]


def fill_rows(manager: TieringOffloadingManager) -> None:
    """Distinct, incompressible bytes in every slot of the primary tier, before any timing."""
    if manager.region is None:
        return
    rows = manager.region.primary_view
    seed = os.urandom(rows.row_bytes)
    for slot in range(len(rows)):
        rows[slot][:] = seed[slot % 4096 :] + seed[: slot % 4096]


async def cascade(manager: TieringOffloadingManager, keys: Sequence[OffloadKey], job: int) -> float:
    """Seconds to store ``keys`` in jobs of ``job`` and cascade them all to the tiers."""
    started = time.perf_counter()
    for first in range(0, len(keys), job):
        batch, req = list(keys[first : first + job]), ReqContext(f"w{first}")
        while (out := manager.prepare_store(batch, req)) is None:
            manager.on_schedule_end()
            await manager.wait_for_completions()
        manager.complete_store(out.keys_to_store, req)
        manager.on_request_finished(req)
    await manager.drain()
    return time.perf_counter() - started


async def promote(
    manager: TieringOffloadingManager,
    keys: Sequence[OffloadKey],
    job: int,
    in_flight: int,
    *,
    tag: str = "r",
    strict: bool = False,
) -> tuple[float, list[float]]:
    """Seconds to promote ``keys`` back, and each request's submit-to-ready latency.

    Each request of ``job`` chunks is one promotion job, ``in_flight`` at once. Every
    key is looked up each step (no short-circuit): the first step's lookups queue the
    whole batch, which goes to the tier as one job. With ``strict``, a miss fails the
    benchmark instead of being retried.
    """
    latencies: list[float] = []
    gate = asyncio.Semaphore(in_flight)

    async def one(first: int) -> None:
        async with gate:
            batch, req = keys[first : first + job], ReqContext(f"{tag}{first}")
            submitted = time.perf_counter()
            while True:
                results = [manager.lookup(key, req) for key in batch]
                if results.count(LookupResult.HIT) == len(batch):
                    break
                if strict and LookupResult.MISS in results:
                    raise RuntimeError(f"promotion of chunks {first}.. missed")
                manager.on_schedule_end()
                await manager.wait_for_completions()
            latencies.append(time.perf_counter() - submitted)
            manager.on_request_finished(req)

    started = time.perf_counter()
    await asyncio.gather(*(one(first) for first in range(0, len(keys), job)))
    return time.perf_counter() - started, latencies
