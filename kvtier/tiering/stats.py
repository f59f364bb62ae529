"""What the manager counts between metric flushes, and its cumulative totals.

Counts are kept per tier label as plain dictionaries keyed by metric name: recording a
new metric is one definition in :mod:`kvtier.metrics` and one increment where the event
happens; :meth:`Counts.flush` hands everything to Prometheus in one pass. Names without
a definition in the spec's metric set cost a dictionary update and are dropped at the
flush (the CPU spec defines no per-tier metrics).
"""

from __future__ import annotations

from collections import defaultdict

from kvtier.metrics import MetricsRecorder, Names

__all__ = ["TOTALS", "Counts", "tier_totals"]


class Counts:
    """Counter increments and histogram samples since the last flush, for one label."""

    __slots__ = ("counters", "labels", "samples")

    def __init__(self, label: str | None = None) -> None:
        self.labels: tuple[str, ...] = () if label is None else (label,)
        self.counters: defaultdict[str, float] = defaultdict(float)
        self.samples: defaultdict[str, list[float]] = defaultdict(list)

    def flush(self, metrics: MetricsRecorder) -> None:
        counters, self.counters = self.counters, defaultdict(float)
        samples, self.samples = self.samples, defaultdict(list)
        labels = self.labels
        for name, amount in counters.items():
            metrics.inc(name, amount, labels)
        for name, values in samples.items():
            metrics.observe_many(name, values, labels)


#: The cumulative figures :func:`tier_totals` reports, by the name it gives them.
TOTALS = (
    ("queries", Names.CHUNK_QUERIES),
    ("hits", Names.CHUNK_HITS),
    ("lookup_failures", Names.LOOKUP_FAILURES),
    ("bytes_read", Names.READ_BYTES),
    ("bytes_written", Names.WRITE_BYTES),
    ("read_time", Names.READ_TIME),
    ("write_time", Names.WRITE_TIME),
    ("integrity_failures", Names.INTEGRITY_FAILURES),
    ("stores_dropped", Names.BACKPRESSURE_STORES_DROPPED),
    ("promotion_failures", Names.PROMOTION_JOB_FAILURES),
    ("cascade_failures", Names.CASCADE_JOB_FAILURES),
)


def tier_totals(metrics: MetricsRecorder, labels: list[str]) -> dict[str, dict[str, float]]:
    """Cumulative counts per tier label, as flushed so far."""
    return {
        label: {
            name: metrics.sample(f"{metric}_total", {"tier": label}) or 0.0
            for name, metric in TOTALS
        }
        for label in labels
    }
