"""What the manager counts between metric flushes, and its cumulative totals.

Counts are kept per tier label as plain dictionaries keyed by metric name: recording a
new metric is one definition in :mod:`kvtier.metrics` and one increment where the event
happens; :meth:`Counts.flush` hands everything to Prometheus in one pass. Names without
a definition in the spec's metric set cost a dictionary update and are dropped at the
flush (the CPU spec defines no per-tier metrics).

A histogram keeps only bucket counts, and a percentile read from them is a bucket
edge, not a time anyone measured. So the samples of the names in :data:`MEASURED`
are also kept, as a bounded uniform sample (:class:`Reservoir`), for percentiles
computed from the values themselves (:meth:`Counts.measured`).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable

from kvtier.metrics import MetricsRecorder, Names

__all__ = ["MEASURED", "TOTALS", "Counts", "Reservoir", "tier_totals"]

#: Histogram names whose measured samples are kept for percentiles.
MEASURED = frozenset({Names.PROMOTION_LATENCY, Names.PROMOTION_JOB_TIME})


class Reservoir:
    """A uniform sample of at most ``capacity`` of the values added (Vitter's algorithm R).

    Until ``capacity`` values came, it holds them all; after that each new value
    replaces a random one with the probability that keeps every value seen equally
    likely to be held. Memory stays bounded however long the process runs.
    """

    __slots__ = ("_random", "capacity", "seen", "values")

    #: One promotion job per request: 4096 samples hold every job of a benchmark run
    #: and bound a long-running engine's memory to 32 KiB per tier.
    DEFAULT_CAPACITY = 4096

    def __init__(self, capacity: int = DEFAULT_CAPACITY, seed: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"a reservoir needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity
        self.values: list[float] = []
        #: Values added so far, the ones no longer held included.
        self.seen = 0
        # Seeded: the same run keeps the same sample.
        self._random = random.Random(seed)

    def extend(self, values: Iterable[float]) -> None:
        held, capacity = self.values, self.capacity
        for value in values:
            self.seen += 1
            if len(held) < capacity:
                held.append(value)
                continue
            slot = self._random.randrange(self.seen)
            if slot < capacity:
                held[slot] = value


class Counts:
    """Counter increments and histogram samples since the last flush, for one label."""

    __slots__ = ("counters", "kept", "labels", "samples")

    def __init__(self, label: str | None = None) -> None:
        self.labels: tuple[str, ...] = () if label is None else (label,)
        self.counters: defaultdict[str, float] = defaultdict(float)
        self.samples: defaultdict[str, list[float]] = defaultdict(list)
        #: Samples of the :data:`MEASURED` names flushed so far, bounded.
        self.kept: dict[str, Reservoir] = {}

    def flush(self, metrics: MetricsRecorder) -> None:
        counters, self.counters = self.counters, defaultdict(float)
        samples, self.samples = self.samples, defaultdict(list)
        labels = self.labels
        for name, amount in counters.items():
            metrics.inc(name, amount, labels)
        for name, values in samples.items():
            metrics.observe_many(name, values, labels)
            if name in MEASURED:
                kept = self.kept.get(name)
                if kept is None:
                    kept = self.kept[name] = Reservoir()
                kept.extend(values)

    def measured(self, name: str) -> list[float]:
        """The samples of ``name`` (one of :data:`MEASURED`) kept so far, flushed or not."""
        if name not in MEASURED:
            raise ValueError(f"samples of {name!r} are not kept; kept are {sorted(MEASURED)}")
        kept = self.kept.get(name)
        return (kept.values if kept is not None else []) + self.samples.get(name, [])


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
    ("late_completions", Names.LATE_COMPLETIONS),
    ("skipped_slower_than_recompute", Names.SKIPPED_SLOWER_THAN_RECOMPUTE),
)


def tier_totals(metrics: MetricsRecorder, labels: list[str]) -> dict[str, dict[str, float]]:
    """Cumulative counts per tier label, as flushed so far."""
    return {
        label: {name: metrics.total(metric, (label,)) for name, metric in TOTALS}
        for label in labels
    }
