"""Physical limits: each tier is held against what its bench tier entry measures."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvtier import SecondaryTier, TierContext
from kvtier.bench import (
    BenchSettings,
    BenchTier,
    BenchTierRegistry,
    Direction,
    Limit,
    LimitContext,
    LocalTier,
    TierTraffic,
)
from kvtier.bench.limits import FASTER_THAN_MEASURED, measure_limits
from kvtier.bench.registry import AboveLimit
from kvtier.region import PrimaryView
from kvtier.tiers.example import ExampleTier

pytestmark = pytest.mark.anyio

CHUNK = 1 << 20
LIMITS = (
    Limit(Direction.WRITE, "example write", "example_write_gbps", "example_write"),
    Limit(Direction.READ, "example read", "example_read_gbps", "example_read"),
)


@contextlib.asynccontextmanager
async def start(settings: BenchSettings, workspace: Path) -> AsyncIterator[LocalTier]:
    yield LocalTier({"type": "example"})


def example_tier(label: str) -> ExampleTier:
    row = memoryview(bytearray(64))
    return ExampleTier(TierContext(PrimaryView(row, 1, 64), 64, "namespace", label))


def registry(
    measured: list[tuple[SecondaryTier, LimitContext]], above_limit: AboveLimit | None = None
) -> BenchTierRegistry:
    async def measure(tier: SecondaryTier, run: LimitContext) -> dict[Direction, float]:
        measured.append((tier, run))
        return {Direction.WRITE: 4.0, Direction.READ: 2.0}

    return BenchTierRegistry(
        [BenchTier("example", ExampleTier, start, measure, LIMITS, above_limit)]
    )


async def limits_of(
    tiers: dict[str, tuple[SecondaryTier, TierTraffic]], entries: BenchTierRegistry
) -> tuple[dict[str, float], dict[str, float | None], dict[str, str]]:
    return await measure_limits(
        tiers, entries, chunk_bytes=CHUNK, workspace=Path("/nowhere"), memcpy=lambda: 9.87654
    )


async def test_a_tier_s_ratios_are_its_rates_over_the_limits_its_entry_measured():
    measured: list[tuple[SecondaryTier, LimitContext]] = []
    tier = example_tier("1:example")
    traffic = TierTraffic(64 * CHUNK, 32 * CHUNK, write_gbps=1.0, read_gbps=0.5)

    physical, ratios, notes = await limits_of({"1:example": (tier, traffic)}, registry(measured))

    assert physical == {
        "memcpy_gbps": 9.877,
        "example_write_gbps": 4.0,
        "example_read_gbps": 2.0,
    }
    assert ratios == {"example_write": 0.25, "example_read": 0.25}
    assert notes == {}  # no ratio above 1, nothing to explain
    assert measured == [(tier, LimitContext(CHUNK, Path("/nowhere"), traffic))]


async def test_only_the_first_tier_of_a_type_is_measured():
    measured: list[tuple[SecondaryTier, LimitContext]] = []
    first, second = example_tier("1:example"), example_tier("2:example")
    busy = TierTraffic(CHUNK, CHUNK, write_gbps=2.0, read_gbps=2.0)
    idle = TierTraffic(0, 0, write_gbps=0.0, read_gbps=0.0)

    _, ratios, _ = await limits_of(
        {"1:example": (first, busy), "2:example": (second, idle)}, registry(measured)
    )

    assert [tier for tier, _ in measured] == [first]
    assert ratios == {"example_write": 0.5, "example_read": 1.0}


async def test_a_way_the_tier_moved_nothing_has_a_limit_but_no_ratio():
    no_reads = TierTraffic(CHUNK, 0, write_gbps=1.0, read_gbps=0.0)

    physical, ratios, _ = await limits_of(
        {"1:example": (example_tier("1:example"), no_reads)}, registry([])
    )

    assert physical["example_read_gbps"] == 2.0
    assert ratios == {"example_write": 0.25, "example_read": None}


async def test_a_tier_no_entry_covers_is_held_against_memory_bandwidth_only():
    traffic = TierTraffic(CHUNK, CHUNK, write_gbps=1.0, read_gbps=1.0)

    physical, ratios, _ = await limits_of(
        {"1:example": (example_tier("1:example"), traffic)}, BenchTierRegistry()
    )

    assert physical == {"memcpy_gbps": 9.877}
    assert ratios == {}


def reads_through_a_cache(tier: SecondaryTier, direction: Direction) -> str | None:
    return "it reads from a cache" if direction is Direction.READ else None


async def test_a_ratio_above_1_comes_with_the_route_its_entry_names():
    # Reads at 3 GB/s against a 2 GB/s limit, writes at 2 against 4.
    traffic = TierTraffic(CHUNK, CHUNK, write_gbps=2.0, read_gbps=3.0)

    _, ratios, notes = await limits_of(
        {"1:example": (example_tier("1:example"), traffic)}, registry([], reads_through_a_cache)
    )

    assert ratios == {"example_write": 0.5, "example_read": 1.5}
    assert notes == {"example_read": "it reads from a cache"}


async def test_a_ratio_above_1_without_a_route_says_the_hardware_was_faster_than_measured():
    traffic = TierTraffic(CHUNK, CHUNK, write_gbps=8.0, read_gbps=1.0)

    # Writes beat the limit, and the entry knows no route around it for writes.
    _, ratios, notes = await limits_of(
        {"1:example": (example_tier("1:example"), traffic)}, registry([], reads_through_a_cache)
    )

    assert ratios["example_write"] == 2.0
    assert notes == {"example_write": FASTER_THAN_MEASURED}
