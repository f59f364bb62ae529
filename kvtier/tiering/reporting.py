"""What the manager counts, on its way to Prometheus, and the figures read back from it.

What the manager counts between metric flushes, and its cumulative totals.

Counts are kept per tier label as plain dictionaries keyed by metric name: recording a
new metric is one definition in :mod:`kvtier.metrics` and one increment where the event
happens; :meth:`Counts.flush` hands everything to Prometheus in one pass. Names without
a definition in the spec's metric set cost a dictionary update and are dropped at the
flush (the CPU spec defines no per-tier metrics).

A histogram keeps only bucket counts, and a percentile read from them is a bucket
edge, not a time anyone measured. So the samples of the names in :data:`MEASURED`
are also kept, as a bounded uniform sample (:class:`Reservoir`), for percentiles
computed from the values themselves (:meth:`Counts.measured`).

:class:`Reporting` hands the counts to the metrics recorder at the end of a step (at
most every :data:`FLUSH_INTERVAL_S`), at a drain, at close, and whenever the registry
is collected, so a scrape always sees current counts. :class:`Diagnostics` is the
direct read, without a scrape, that ``kvtier bench``, the benchmarks and operators use.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvtier.metrics import MetricsRecorder, Names
from kvtier.primary import PRIMARY_LABEL

if TYPE_CHECKING:
    from kvtier.tiering.core import TieringCore
    from kvtier.tiering.jobs import InFlight
    from kvtier.tiering.state import TierState

__all__ = [
    "FLUSH_INTERVAL_S",
    "MEASURED",
    "TOTALS",
    "Counts",
    "Diagnostics",
    "Reporting",
    "Reservoir",
    "tier_totals",
]

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


# How often the end of a step flushes counts to Prometheus. A collection of the
# registry flushes first anyway, so scrapes always see current counts; this only bounds
# what piles up between scrapes. A flush with one tier costs about 30 us, 70% of an
# idle step's end: a scheduler stepping every millisecond paid it on every step.
FLUSH_INTERVAL_S = 0.25


class Reporting:
    """The primary tier's and the manager's own counts, and every tier's, flushed."""

    def __init__(self, core: TieringCore) -> None:
        self.metrics = core.metrics
        self._core = core
        #: Counts of the primary tier, and of the manager's unlabelled metrics.
        self.primary_counts = Counts(PRIMARY_LABEL)
        self.counts = Counts()
        self._flushed_at = 0.0
        #: Each tier's integrity failures handed to the recorder so far.
        self._integrity_reported = [0] * len(core.tiers)

    def flush(self) -> None:
        """Hand everything counted since the last flush to the recorder."""
        self._flushed_at = time.perf_counter()
        metrics = self.metrics
        core = self._core
        primary = core.primary
        metrics.set(Names.CPU_CACHE_USAGE_PERC, primary.num_busy / primary.num_chunks)
        if core.tiers:
            metrics.set(Names.QUARANTINED_SLOTS, core.ledger.quarantined)
        self.counts.flush(metrics)
        self.primary_counts.flush(metrics)
        for state, in_flight in zip(core.tiers, core.jobs.in_flight, strict=True):
            self._flush_tier(state, in_flight, primary.num_chunks)

    def _flush_tier(self, state: TierState, in_flight: InFlight, num_chunks: int) -> None:
        """Hand one tier's counts and gauges to the recorder."""
        metrics = self.metrics
        state.counts.flush(metrics)
        label = state.counts.labels
        metrics.set(Names.PRIMARY_WRITE_USAGE_PERC, in_flight.promotion_chunks / num_chunks, label)
        metrics.set(Names.PRIMARY_READ_USAGE_PERC, in_flight.cascade_chunks / num_chunks, label)
        metrics.set(Names.ACTIVE_PROMOTION_JOBS, in_flight.promotions, label)
        metrics.set(Names.ACTIVE_CASCADE_JOBS, in_flight.cascades, label)
        integrity = state.tier.ctx.counters.integrity_failures
        reported = self._integrity_reported[state.index]
        metrics.inc(Names.INTEGRITY_FAILURES, integrity - reported, label)
        self._integrity_reported[state.index] = integrity
        backpressure = state.backpressure
        if backpressure is not None:
            metrics.set(Names.BACKPRESSURE_STORE_LATENCY_EMA, backpressure.ema, label)
            stores, chunks = backpressure.take_dropped()
            metrics.inc(Names.BACKPRESSURE_STORES_DROPPED, stores, label)
            metrics.inc(Names.BACKPRESSURE_CHUNKS_DROPPED, chunks, label)

    def flush_if_due(self) -> None:
        if time.perf_counter() - self._flushed_at >= FLUSH_INTERVAL_S:
            self.flush()

    def totals(self) -> dict[str, dict[str, float]]:
        """Cumulative counts per tier label, the primary tier's first, flushed first."""
        self.flush()
        labels = [PRIMARY_LABEL, *(state.label for state in self._core.tiers)]
        return tier_totals(self.metrics, labels)

    def measured(self, name: str) -> dict[str, list[float]]:
        """The kept samples of ``name``, by secondary tier label."""
        return {state.label: state.counts.measured(name) for state in self._core.tiers}


class Diagnostics:
    """Read-only figures of one manager."""

    def __init__(self, core: TieringCore) -> None:
        self._core = core
        self._lock = core.lock
        self._report = core.report

    @property
    def tier_labels(self) -> list[str]:
        """The secondary tiers' labels, in order."""
        return [state.label for state in self._core.tiers]

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """Cumulative counts per tier label, the primary tier's first."""
        with self._lock:
            return self._report.totals()

    @property
    def tracked_requests(self) -> int:
        """Requests the manager keeps a record of: those that have not finished, and
        finished ones whose stores or promotions are still in flight. A count that only
        grows means a host that does not report the requests that finished."""
        with self._lock:
            return len(self._core.requests)

    @property
    def quarantined_slots(self) -> int:
        """Primary slots kept out of use for I/O that a timed-out job may still run."""
        with self._lock:
            return self._core.ledger.quarantined

    def promotion_latencies(self) -> dict[str, list[float]]:
        """Measured promotion job latencies in seconds, by secondary tier label.

        Each is one job's time from the lookup that found its first key in the tier
        until its chunks were readable in the primary tier. A bounded uniform sample
        (:class:`Reservoir`): percentiles taken from it are
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
