"""The manager's counts on their way to Prometheus, and the figures read back from them.

The manager counts into plain dictionaries (:class:`~kvtier.tiering.stats.Counts`)
under its lock; :class:`Reporting` hands them to the metrics recorder at the end of a
step (at most every :data:`FLUSH_INTERVAL_S`), at a drain, at close, and whenever the
registry is collected, so a scrape always sees current counts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvtier.metrics import MetricsRecorder, Names
from kvtier.primary import PRIMARY_LABEL, PrimaryTier
from kvtier.tiering.jobs import InFlight
from kvtier.tiering.ledger import SlotLedger
from kvtier.tiering.state import TierState
from kvtier.tiering.stats import Counts, tier_totals

__all__ = ["FLUSH_INTERVAL_S", "Reporting"]

# How often the end of a step flushes counts to Prometheus. A collection of the
# registry flushes first anyway, so scrapes always see current counts; this only bounds
# what piles up between scrapes. A flush with one tier costs about 30 us, 70% of an
# idle step's end: a scheduler stepping every millisecond paid it on every step.
FLUSH_INTERVAL_S = 0.25


class Reporting:
    """The primary tier's and the manager's own counts, and every tier's, flushed."""

    def __init__(
        self,
        metrics: MetricsRecorder,
        primary: PrimaryTier,
        ledger: SlotLedger,
        tiers: Sequence[TierState],
        in_flight: Sequence[InFlight],
    ) -> None:
        self.metrics = metrics
        self._primary = primary
        self._ledger = ledger
        self._tiers = tiers
        self._in_flight = in_flight
        #: Counts of the primary tier, and of the manager's unlabelled metrics.
        self.primary_counts = Counts(PRIMARY_LABEL)
        self.counts = Counts()
        self._flushed_at = 0.0

    def flush(self) -> None:
        """Hand everything counted since the last flush to the recorder."""
        self._flushed_at = time.perf_counter()
        metrics = self.metrics
        primary = self._primary
        metrics.set(Names.CPU_CACHE_USAGE_PERC, primary.num_busy / primary.num_chunks)
        if self._tiers:
            metrics.set(Names.QUARANTINED_SLOTS, self._ledger.quarantined)
        self.counts.flush(metrics)
        self.primary_counts.flush(metrics)
        for state, in_flight in zip(self._tiers, self._in_flight, strict=True):
            state.flush(metrics, in_flight, primary.num_chunks)

    def flush_if_due(self) -> None:
        if time.perf_counter() - self._flushed_at >= FLUSH_INTERVAL_S:
            self.flush()

    def totals(self) -> dict[str, dict[str, float]]:
        """Cumulative counts per tier label, the primary tier's first, flushed first."""
        self.flush()
        return tier_totals(self.metrics, [PRIMARY_LABEL, *(state.label for state in self._tiers)])

    def measured(self, name: str) -> dict[str, list[float]]:
        """The kept samples of ``name``, by secondary tier label."""
        return {state.label: state.counts.measured(name) for state in self._tiers}
