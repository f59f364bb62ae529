"""The physical limits a run's tiers are held against, and the tiers' ratios to them.

Memory bandwidth is measured in every run; each tier adds the limit its bench tier
entry measures (the first tier of each type only: two fs tiers share one disk figure).
A ratio is None where the tier moved nothing that way (no-reuse never reads back).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path

from kvtier.bench.physical import measure_memcpy
from kvtier.bench.registry import MEMCPY_KEY, BenchTierRegistry, LimitContext, TierTraffic
from kvtier.tiers import SecondaryTier

__all__ = ["measure_limits"]


async def measure_limits(
    tiers: Mapping[str, tuple[SecondaryTier, TierTraffic]],
    registry: BenchTierRegistry,
    *,
    chunk_bytes: int,
    workspace: Path,
    memcpy: Callable[[], float] = measure_memcpy,
) -> tuple[dict[str, float], dict[str, float | None]]:
    """``(physical, ratios)`` for ``tiers`` (built tiers and their traffic, by label).

    ``physical`` holds GB/s by :attr:`Limit.key`, ``ratios`` the tiers' GB/s over
    those by :attr:`Limit.ratio`, in the order of the tiers.
    """
    physical = {MEMCPY_KEY: round(await asyncio.to_thread(memcpy), 3)}
    ratios: dict[str, float | None] = {}
    measured: set[str] = set()
    for tier, traffic in tiers.values():
        entry = registry.for_class(type(tier))
        if entry is None or entry.measure is None or entry.name in measured:
            continue
        measured.add(entry.name)
        limits = await entry.measure(tier, LimitContext(chunk_bytes, workspace, traffic))
        for limit in entry.limits:
            gbps = limits[limit.direction]
            physical[limit.key] = round(gbps, 3)
            ratios[limit.ratio] = _ratio(traffic.gbps(limit.direction), gbps)
    return physical, ratios


def _ratio(measured: float | None, limit: float) -> float | None:
    return round(measured / limit, 3) if measured and limit else None
