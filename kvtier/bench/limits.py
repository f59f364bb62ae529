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

__all__ = ["FASTER_THAN_MEASURED", "PHASE", "measure_limits"]

#: How the run's phase reads while limits are measured; each limit's name follows it.
PHASE = "measuring the physical limits"

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
    phase: Callable[[str], None] | None = None,
) -> tuple[dict[str, float], dict[str, float | None], dict[str, str]]:
    """``(physical, ratios, notes)`` for ``tiers`` (built tiers and their traffic, by label).

    ``physical`` holds GB/s by :attr:`Limit.key`, ``ratios`` the tiers' GB/s over
    those by :attr:`Limit.ratio`, in the order of the tiers; ``notes`` why a ratio is
    above 1, by :attr:`Limit.ratio`. ``phase`` hears which limit is being measured,
    and each step of a measurement that reports its steps (from any thread).
    """
    say = phase if phase is not None else _silent
    say(f"{PHASE}: memcpy")
    physical = {MEMCPY_KEY: round(await asyncio.to_thread(memcpy), 3)}
    ratios: dict[str, float | None] = {}
    notes: dict[str, str] = {}
    measured: set[str] = set()
    for tier, traffic in tiers.values():
        entry = registry.for_class(type(tier))
        if entry is None or entry.measure is None or entry.name in measured:
            continue
        measured.add(entry.name)
        labels = ", ".join(limit.label for limit in entry.limits)
        say(f"{PHASE}: {entry.name} ({labels})")
        context = LimitContext(
            chunk_bytes,
            workspace,
            traffic,
            progress=_steps_of(entry.name, say),
        )
        limits = await entry.measure(tier, context)
        for limit in entry.limits:
            gbps = limits[limit.direction]
            physical[limit.key] = round(gbps, 3)
            ratio = ratios[limit.ratio] = _ratio(traffic.gbps(limit.direction), gbps)
            if ratio is not None and ratio > 1:
                route = entry.above_limit(tier, limit.direction) if entry.above_limit else None
                notes[limit.ratio] = route or FASTER_THAN_MEASURED
    return physical, ratios, notes


def _steps_of(name: str, say: Callable[[str], None]) -> Callable[[str], None]:
    """How the steps of bench tier ``name``'s measurement reach the run's phase."""

    def step(text: str) -> None:
        say(f"{PHASE}: {name}, {text}")

    return step


def _silent(text: str) -> None:
    pass


def _ratio(measured: float | None, limit: float) -> float | None:
    return round(measured / limit, 3) if measured and limit else None
