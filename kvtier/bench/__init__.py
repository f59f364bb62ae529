"""``kvtier bench``: serving workloads replayed through the whole stack.

A tier type joins the bench by registering a :class:`BenchTier` in :data:`BENCH_TIERS`
(see :mod:`kvtier.bench.registry`).
"""

from kvtier.bench.registry import (
    BenchTier,
    BenchTierRegistry,
    Direction,
    Limit,
    LimitContext,
    LocalTier,
    TierTraffic,
)
from kvtier.bench.run import run_bench
from kvtier.bench.settings import BenchSettings
from kvtier.bench.tiers import BENCH_TIERS
from kvtier.bench.workloads import WORKLOADS, WorkloadSize, build_workload

__all__ = [
    "BENCH_TIERS",
    "WORKLOADS",
    "BenchSettings",
    "BenchTier",
    "BenchTierRegistry",
    "Direction",
    "Limit",
    "LimitContext",
    "LocalTier",
    "TierTraffic",
    "WorkloadSize",
    "build_workload",
    "run_bench",
]
