"""``kvtier bench``: serving workloads replayed through the whole stack.

A tier type joins the bench by registering a :class:`BenchTier` in :data:`BENCH_TIERS`
(see :mod:`kvtier.bench.registry`).

Each name is imported the first time it is used, not when the package is: the
``kvtier`` command lists the workloads and tiers in its help without importing the
replay, and with it torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier._lazy import lazy_names

if TYPE_CHECKING:
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

#: Where each public name lives: the module imported when the name is first used.
_HOMES = {
    "BENCH_TIERS": "kvtier.bench.tiers",
    "WORKLOADS": "kvtier.bench.workloads",
    "BenchSettings": "kvtier.bench.settings",
    "BenchTier": "kvtier.bench.registry",
    "BenchTierRegistry": "kvtier.bench.registry",
    "Direction": "kvtier.bench.registry",
    "Limit": "kvtier.bench.registry",
    "LimitContext": "kvtier.bench.registry",
    "LocalTier": "kvtier.bench.registry",
    "TierTraffic": "kvtier.bench.registry",
    "WorkloadSize": "kvtier.bench.workloads",
    "build_workload": "kvtier.bench.workloads",
    "run_bench": "kvtier.bench.run",
}

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


__getattr__, __dir__ = lazy_names(__name__, _HOMES, __all__)
