"""The manager's view of one secondary tier: the parts, each owned by its own module.

A :class:`TierState` only ties together what concerns one tier: its runner (jobs on
the tier loop, :mod:`~kvtier.tiering.runner`), its back-pressure, its lookup answers
(:mod:`~kvtier.tiering.lookups`) and its counts. Its promotion queue lives in
:mod:`~kvtier.tiering.promotions` and its jobs in flight in :mod:`~kvtier.tiering.jobs`,
by the tier's index.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.metrics import MetricsRecorder, Names
from kvtier.tiering.backpressure import Backpressure
from kvtier.tiering.jobs import InFlight
from kvtier.tiering.lookups import TierLookups
from kvtier.tiering.options import TierOptions
from kvtier.tiering.outcomes import Outcome
from kvtier.tiering.runner import TierRunner
from kvtier.tiering.stats import Counts
from kvtier.tiers.base import SecondaryTier

__all__ = ["TierState"]


class TierState:
    """One secondary tier as the manager sees it."""

    __slots__ = (
        "_integrity_reported",
        "backpressure",
        "counts",
        "label",
        "lookups",
        "runner",
        "tier",
    )

    def __init__(self, runner: TierRunner, backpressure: Backpressure | None) -> None:
        self.runner = runner
        self.tier = runner.tier
        self.label = runner.label
        self.backpressure = backpressure
        self.counts = Counts(self.label)
        self.lookups = TierLookups(self.tier, self.counts)
        self._integrity_reported = 0

    @classmethod
    def build(
        cls,
        tiers: Sequence[SecondaryTier],
        options: Sequence[TierOptions],
        post: Callable[[Outcome], None],
    ) -> list[TierState]:
        """One state per tier, its runner posting outcomes through ``post``."""
        return [
            cls(
                TierRunner(index, tier, opt.runner, post),
                Backpressure(opt.backpressure) if opt.backpressure is not None else None,
            )
            for index, (tier, opt) in enumerate(zip(tiers, options, strict=True))
        ]

    def flush(self, metrics: MetricsRecorder, in_flight: InFlight, num_chunks: int) -> None:
        """Hand the tier's counts and gauges to the recorder."""
        self.counts.flush(metrics)
        label = self.counts.labels
        metrics.set(Names.PRIMARY_WRITE_USAGE_PERC, in_flight.promotion_chunks / num_chunks, label)
        metrics.set(Names.PRIMARY_READ_USAGE_PERC, in_flight.cascade_chunks / num_chunks, label)
        metrics.set(Names.ACTIVE_PROMOTION_JOBS, in_flight.promotions, label)
        metrics.set(Names.ACTIVE_CASCADE_JOBS, in_flight.cascades, label)
        integrity = self.tier.ctx.counters.integrity_failures
        metrics.inc(Names.INTEGRITY_FAILURES, integrity - self._integrity_reported, label)
        self._integrity_reported = integrity
        if self.backpressure is not None:
            metrics.set(Names.BACKPRESSURE_STORE_LATENCY_EMA, self.backpressure.ema, label)
            stores, chunks = self.backpressure.take_dropped()
            metrics.inc(Names.BACKPRESSURE_STORES_DROPPED, stores, label)
            metrics.inc(Names.BACKPRESSURE_CHUNKS_DROPPED, chunks, label)
