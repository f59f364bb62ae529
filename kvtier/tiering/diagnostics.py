"""Counts and measured samples of a manager, for benchmarks, tools and operators.

Prometheus gets the same figures through the metrics registry; this is the direct
read, without a scrape, that ``kvtier bench`` and the benchmarks use.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from kvtier.metrics import Names
from kvtier.tiering.ledger import SlotLedger
from kvtier.tiering.reporting import Reporting
from kvtier.tiering.state import TierState

__all__ = ["Diagnostics"]


class Diagnostics:
    """Read-only figures of one manager."""

    def __init__(
        self,
        lock: AbstractContextManager[Any],
        report: Reporting,
        ledger: SlotLedger,
        tiers: Sequence[TierState],
    ) -> None:
        self._lock = lock
        self._report = report
        self._ledger = ledger
        self._tiers = tiers

    @property
    def tier_labels(self) -> list[str]:
        """The secondary tiers' labels, in order."""
        return [state.label for state in self._tiers]

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """Cumulative counts per tier label, the primary tier's first."""
        with self._lock:
            return self._report.totals()

    @property
    def quarantined_slots(self) -> int:
        """Primary slots kept out of use for I/O that a timed-out job may still run."""
        with self._lock:
            return self._ledger.quarantined

    def promotion_latencies(self) -> dict[str, list[float]]:
        """Measured promotion job latencies in seconds, by secondary tier label.

        Each is one job's time from the lookup that found its first key in the tier
        until its chunks were readable in the primary tier. A bounded uniform sample
        (:class:`~kvtier.tiering.stats.Reservoir`): percentiles taken from it are
        measured times, not the edges of histogram buckets.
        """
        return self._measured(Names.PROMOTION_LATENCY)

    def promotion_job_times(self) -> dict[str, list[float]]:
        """Measured promotion job times in seconds, by secondary tier label.

        Each is one job's time from its start on the tier until its chunks were
        readable: :meth:`promotion_latencies` less the wait for a free job (see the
        ``max_promotion_chunks`` setting). A bounded uniform sample, as there.
        """
        return self._measured(Names.PROMOTION_JOB_TIME)

    def _measured(self, name: str) -> dict[str, list[float]]:
        with self._lock:
            return self._report.measured(name)
