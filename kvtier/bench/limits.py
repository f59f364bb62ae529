"""The physical limits a run's tiers are held against, and the tiers' ratios to them.

Memory bandwidth is measured in every run; each tier adds the limit its bench tier
entry measures (the first tier of each type only: two fs tiers share one disk figure).
A ratio is None where the tier moved nothing that way (no-reuse never reads back). A
ratio above 1 comes with the reason: the entry's (a route the raw I/O does not take),
else that the hardware's speed changed between the run and its measurement.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path

from kvtier.bench.physical import measure_memcpy
from kvtier.bench.registry import MEMCPY_KEY, BenchTierRegistry, LimitContext, TierTraffic
from kvtier.tiers import SecondaryTier

__all__ = ["FASTER_THAN_MEASURED", "measure_limits"]

#: Why a tier beat a limit measured at its own depths, when its entry knows no route
#: around the limit: the limit is measured once, after the run.
FASTER_THAN_MEASURED = (
    "the limit was measured once, after the run, and the hardware was faster while "
    "kvtier used it (its speed varies with other load, a cloud volume's with its burst "
    "credits): read it as at the limit"
)


async def measure_limits(
    tiers: Mapping[str, tuple[SecondaryTier, TierTraffic]],
    registry: BenchTierRegistry,
    *,
    chunk_bytes: int,
    workspace: Path,
    memcpy: Callable[[], float] = measure_memcpy,
) -> tuple[dict[str, float], dict[str, float | None], dict[str, str]]:
    """``(physical, ratios, notes)`` for ``tiers`` (built tiers and their traffic, by label).

    ``physical`` holds GB/s by :attr:`Limit.key`, ``ratios`` the tiers' GB/s over
    those by :attr:`Limit.ratio`, in the order of the tiers; ``notes`` why a ratio is
    above 1, by :attr:`Limit.ratio`.
    """
    physical = {MEMCPY_KEY: round(await asyncio.to_thread(memcpy), 3)}
    ratios: dict[str, float | None] = {}
    notes: dict[str, str] = {}
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
            ratio = ratios[limit.ratio] = _ratio(traffic.gbps(limit.direction), gbps)
            if ratio is not None and ratio > 1:
                route = entry.above_limit(tier, limit.direction) if entry.above_limit else None
                notes[limit.ratio] = route or FASTER_THAN_MEASURED
    return physical, ratios, notes


def _ratio(measured: float | None, limit: float) -> float | None:
    return round(measured / limit, 3) if measured and limit else None
