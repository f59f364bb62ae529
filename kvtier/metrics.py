"""Prometheus metrics: definitions as data, bound to a caller's registry.

A spec (and each tier class) describes its metrics with :class:`CounterDef`,
:class:`GaugeDef` and :class:`HistogramDef` records keyed by name. :class:`MetricsRecorder`
turns them into ``prometheus_client`` objects registered on the registry the host
passes, never on the global default registry unless the host passes that one.

Names follow vLLM's with ``vllm:kv_offload_`` replaced by ``kvtier_``; counters are
exposed with prometheus_client's ``_total`` suffix.

The scheduler's hot path never touches a Prometheus object: the manager adds to plain
integers and flushes them here once per step. The recorder's metrics reach the registry
through one collector of its own, which first asks its source (the manager) to flush
what the step in progress counted: every collection, a scrape of an idle engine
included, sees current counts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from kvtier._logs import describe_failure

logger = logging.getLogger(__name__)

__all__ = [
    "CounterDef",
    "GaugeDef",
    "HistogramDef",
    "MetricDefinition",
    "MetricsRecorder",
    "Names",
    "cpu_metric_definitions",
    "tier_io_metric_definitions",
    "tiering_metric_definitions",
]


@dataclass(frozen=True)
class MetricDefinition:
    documentation: str
    labelnames: tuple[str, ...] = ()


@dataclass(frozen=True)
class CounterDef(MetricDefinition):
    """A monotonically increasing count."""


@dataclass(frozen=True)
class GaugeDef(MetricDefinition):
    """A value that goes up and down."""


@dataclass(frozen=True)
class HistogramDef(MetricDefinition):
    """A distribution; ``buckets`` None means prometheus_client's defaults."""

    buckets: tuple[float, ...] | None = None


class Names:
    """Every metric name kvtier itself records."""

    # CPU spec (primary tier)
    STORES_SKIPPED = "kvtier_stores_skipped"
    CPU_CACHE_USAGE_PERC = "kvtier_cpu_cache_usage_perc"
    CPU_ALLOCATION_SIZE = "kvtier_cpu_allocation_size"
    CPU_EVICTIONS = "kvtier_cpu_evictions"

    # Tiering manager, labelled by tier ("0:primary", "1:fs", ...)
    LOOKUP_SYNC_DELAY = "kvtier_tiering_lookup_sync_delay_seconds"
    LOOKUP_ASYNC_DELAY = "kvtier_tiering_lookup_async_delay_seconds"
    READ_BYTES = "kvtier_tiering_read_bytes"
    READ_TIME = "kvtier_tiering_read_time"
    WRITE_BYTES = "kvtier_tiering_write_bytes"
    WRITE_TIME = "kvtier_tiering_write_time"
    PROMOTION_JOB_FAILURES = "kvtier_tiering_promotion_job_failures"
    CASCADE_JOB_FAILURES = "kvtier_tiering_cascade_job_failures"
    CHUNK_QUERIES = "kvtier_tiering_chunk_queries"
    CHUNK_HITS = "kvtier_tiering_chunk_hits"
    LOOKUP_FAILURES = "kvtier_tiering_lookup_failures"
    PROMOTION_ALLOCATION_FAILURES = "kvtier_tiering_promotion_allocation_failures"
    PRIMARY_WRITE_USAGE_PERC = "kvtier_tiering_primary_write_usage_perc"
    PRIMARY_READ_USAGE_PERC = "kvtier_tiering_primary_read_usage_perc"
    ACTIVE_PROMOTION_JOBS = "kvtier_tiering_active_promotion_jobs"
    ACTIVE_CASCADE_JOBS = "kvtier_tiering_active_cascade_jobs"
    BACKPRESSURE_STORE_LATENCY_EMA = "kvtier_tiering_backpressure_store_latency_ema"
    BACKPRESSURE_STORES_DROPPED = "kvtier_tiering_backpressure_stores_dropped"
    BACKPRESSURE_CHUNKS_DROPPED = "kvtier_tiering_backpressure_chunks_dropped"
    PROMOTION_LATENCY = "kvtier_tiering_promotion_latency_seconds"
    PROMOTION_JOB_TIME = "kvtier_tiering_promotion_job_seconds"
    INTEGRITY_FAILURES = "kvtier_tiering_integrity_failures"
    SKIPPED_SLOWER_THAN_RECOMPUTE = "kvtier_tiering_skipped_slower_than_recompute"
    QUARANTINED_SLOTS = "kvtier_tiering_quarantined_slots"
    LATE_COMPLETIONS = "kvtier_tiering_late_completions"

    # Secondary tiers' own I/O, labelled by tier and direction ("read", "write")
    TIER_IO_DEPTH = "kvtier_tier_io_depth"


def cpu_metric_definitions(store_threshold: int) -> dict[str, MetricDefinition]:
    """The CPU spec's metrics; ``stores_skipped`` exists only when the gate is on."""
    definitions: dict[str, MetricDefinition] = {
        Names.CPU_CACHE_USAGE_PERC: GaugeDef(
            "Fraction of primary-tier slots that cannot be reused right now because "
            "they are being written or are pinned by readers."
        ),
        Names.CPU_ALLOCATION_SIZE: HistogramDef(
            "Chunks allocated in the primary tier per store call.",
            # Store calls carry one request's new chunks: 1 to a few hundred.
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        ),
        Names.CPU_EVICTIONS: CounterDef("Chunks evicted from the primary tier."),
    }
    if store_threshold >= 2:
        definitions[Names.STORES_SKIPPED] = CounterDef(
            "Chunks not stored because they had been looked up fewer than store_threshold times."
        )
    return definitions


_TIER = ("tier",)


def tiering_metric_definitions() -> dict[str, MetricDefinition]:
    """The tiering manager's metrics (the seed's set plus kvtier's own)."""
    return {
        Names.LOOKUP_SYNC_DELAY: HistogramDef(
            "Time a tier took to answer a chunk lookup on the spot, by tier, in seconds.",
            _TIER,
            # In-memory answers take microseconds; anything near a millisecond is a
            # scheduler stall worth seeing.
            buckets=(1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05),
        ),
        Names.LOOKUP_ASYNC_DELAY: HistogramDef(
            "Time from a chunk lookup first answering retry until its tier resolved it, "
            "by tier, in seconds.",
            _TIER,
            # One to a few scheduler steps (tens of ms) is the expected range.
            buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0),
        ),
        Names.READ_BYTES: CounterDef(
            "Bytes read from secondary tiers into the primary tier, by tier.", _TIER
        ),
        Names.READ_TIME: CounterDef(
            "Seconds spent reading from secondary tiers into the primary tier, by tier.", _TIER
        ),
        Names.WRITE_BYTES: CounterDef(
            "Bytes written from the primary tier to secondary tiers, by tier.", _TIER
        ),
        Names.WRITE_TIME: CounterDef(
            "Seconds spent writing from the primary tier to secondary tiers, by tier.", _TIER
        ),
        Names.PROMOTION_JOB_FAILURES: CounterDef(
            "Promotion jobs (secondary -> primary) that failed, by tier.", _TIER
        ),
        Names.CASCADE_JOB_FAILURES: CounterDef(
            "Cascade jobs (primary -> secondary) that failed, by tier.", _TIER
        ),
        Names.CHUNK_QUERIES: CounterDef(
            "Chunks a tier answered for a request, by tier: each (request, tier, chunk) "
            "once, at the first hit or miss the request saw there, and none after the "
            "request was scheduled; a chunk still on its way into the primary tier is "
            "no answer yet.",
            _TIER,
        ),
        Names.CHUNK_HITS: CounterDef(
            "The chunk_queries of a tier whose answer was a hit, by tier.", _TIER
        ),
        Names.LOOKUP_FAILURES: CounterDef(
            "Chunks of a tier's lookup batches that failed or timed out, answered as "
            "misses, by tier (a request that sees such a miss counts it in chunk_queries).",
            _TIER,
        ),
        Names.PROMOTION_ALLOCATION_FAILURES: CounterDef(
            "Secondary-tier hits that found no free primary slot to promote into."
        ),
        Names.PRIMARY_WRITE_USAGE_PERC: GaugeDef(
            "Share of primary slots being written by promotions from a tier, by tier.", _TIER
        ),
        Names.PRIMARY_READ_USAGE_PERC: GaugeDef(
            "Share of primary slots pinned by cascades to a tier, by tier.", _TIER
        ),
        Names.ACTIVE_PROMOTION_JOBS: GaugeDef("Promotion jobs in flight, by tier.", _TIER),
        Names.ACTIVE_CASCADE_JOBS: GaugeDef("Cascade jobs in flight, by tier.", _TIER),
        Names.BACKPRESSURE_STORE_LATENCY_EMA: GaugeDef(
            "Moving average of a tier's store latency, in seconds per MiB, by tier.", _TIER
        ),
        Names.BACKPRESSURE_STORES_DROPPED: CounterDef(
            "Cascade jobs dropped because their tier was under back-pressure, by tier.", _TIER
        ),
        Names.BACKPRESSURE_CHUNKS_DROPPED: CounterDef(
            "Chunks of cascade jobs dropped under back-pressure, by tier.", _TIER
        ),
        Names.PROMOTION_LATENCY: HistogramDef(
            "Time from a secondary-tier hit until its chunks were readable in the primary "
            "tier, per promotion job, by tier, in seconds.",
            _TIER,
            buckets=(1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.09, 0.25, 0.5, 1.0, 2.5, 10.0),
        ),
        Names.PROMOTION_JOB_TIME: HistogramDef(
            "Time from a promotion job's start on its tier until its chunks were readable "
            "in the primary tier, by tier, in seconds (the latency above, less the wait "
            "for a free job).",
            _TIER,
            buckets=(1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.09, 0.25, 0.5, 1.0, 2.5, 10.0),
        ),
        Names.SKIPPED_SLOWER_THAN_RECOMPUTE: CounterDef(
            "Secondary-tier hits answered as misses because the promotion would have "
            "arrived later than the host could recompute the chunk, by tier.",
            _TIER,
        ),
        Names.QUARANTINED_SLOTS: GaugeDef(
            "Primary slots kept out of use because I/O of a job given up at its timeout "
            "may still touch them."
        ),
        Names.LATE_COMPLETIONS: CounterDef(
            "Jobs whose I/O ended after their timeout had failed them, by tier.", _TIER
        ),
        Names.INTEGRITY_FAILURES: CounterDef(
            "Stored chunks that failed verification (checksum, length, key or namespace) "
            "and were discarded instead of served, by tier.",
            _TIER,
        ),
    }


def tier_io_metric_definitions() -> dict[str, MetricDefinition]:
    """Metrics of a tier whose I/O depth is a :class:`~kvtier.tiers._depth.IoDepth`:
    a tier class adds them to its own ``build_metric_definitions``."""
    return {
        Names.TIER_IO_DEPTH: GaugeDef(
            "Operations a tier keeps in flight at once, by tier and direction (read, "
            "write): a fixed depth, or the one its depth controller runs at now.",
            ("tier", "direction"),
        ),
    }


class MetricsRecorder:
    """Prometheus objects for a set of definitions, on one registry.

    Recording a name that has no definition does nothing: a manager records the same
    names whichever spec built it, and each spec defines the ones it exposes.

    The metrics are registered as one collector; :meth:`pull_from` names a function it
    calls at the start of every collection, on whichever thread collects.
    """

    def __init__(
        self,
        definitions: Mapping[str, MetricDefinition],
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.definitions = dict(definitions)
        self._counters: dict[str, Counter] = {}
        self._gauges: dict[str, Gauge] = {}
        self._histograms: dict[str, Histogram] = {}
        self._source: Callable[[], None] | None = None
        # Each counter's value by label values, kept beside Prometheus's own so that
        # reading one (tier_stats(), the bench's timeline) costs a dictionary lookup,
        # not a collection of the whole registry: that took ~5 ms of the event loop.
        self._totals: dict[tuple[str, tuple[str, ...]], float] = {}
        self._totals_lock = threading.Lock()
        for name, definition in self.definitions.items():
            if not isinstance(definition, (CounterDef, GaugeDef, HistogramDef)):
                raise TypeError(f"metric {name!r} has an unknown definition type {definition!r}")
            # On no registry of their own: the collector below hands them over.
            common: dict[str, Any] = {
                "name": name,
                "documentation": definition.documentation,
                "labelnames": definition.labelnames,
                "registry": None,
            }
            if isinstance(definition, CounterDef):
                self._counters[name] = Counter(**common)
            elif isinstance(definition, GaugeDef):
                self._gauges[name] = Gauge(**common)
            elif isinstance(definition, HistogramDef):
                kwargs = dict(common)
                if definition.buckets is not None:
                    kwargs["buckets"] = definition.buckets
                self._histograms[name] = Histogram(**kwargs)
        self.registry.register(_PullingCollector(self))

    def pull_from(self, source: Callable[[], None] | None) -> None:
        """Call ``source`` before every collection (None: stop calling it).

        ``source`` flushes what it counted into this recorder. It may run on any
        thread; an exception it raises is logged and the collection goes on with
        what was flushed before.
        """
        self._source = source

    def pull(self) -> None:
        """Have the source (see :meth:`pull_from`) flush what it counted, now."""
        source = self._source
        if source is None:
            return
        try:
            source()
        except Exception as exc:
            logger.error("flushing metrics for a collection failed: %s", describe_failure(exc))

    def prometheus_metrics(self) -> Iterator[Counter | Gauge | Histogram]:
        """The Prometheus objects of every definition (collected by the registry)."""
        yield from self._counters.values()
        yield from self._gauges.values()
        yield from self._histograms.values()

    def defines(self, name: str) -> bool:
        return name in self.definitions

    def inc(self, name: str, amount: float = 1.0, labels: tuple[str, ...] = ()) -> None:
        counter = self._counters.get(name)
        if counter is not None and amount:
            (counter.labels(*labels) if labels else counter).inc(amount)
            key = (name, tuple(labels))
            with self._totals_lock:
                self._totals[key] = self._totals.get(key, 0.0) + amount

    def total(self, name: str, labels: tuple[str, ...] = ()) -> float:
        """What :meth:`inc` added up to for counter ``name`` and these label values."""
        return self._totals.get((name, tuple(labels)), 0.0)

    def set(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        gauge = self._gauges.get(name)
        if gauge is not None:
            (gauge.labels(*labels) if labels else gauge).set(value)

    def observe(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        histogram = self._histograms.get(name)
        if histogram is not None:
            (histogram.labels(*labels) if labels else histogram).observe(value)

    def observe_many(
        self, name: str, values: Iterable[float], labels: tuple[str, ...] = ()
    ) -> None:
        histogram = self._histograms.get(name)
        if histogram is not None:
            target = histogram.labels(*labels) if labels else histogram
            for value in values:
                target.observe(value)

    def sample(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """The current value of one sample, by its exposed name (tests, the CLI)."""
        return self.registry.get_sample_value(name, dict(labels or {}))


class _PullingCollector:
    """A recorder's metrics as one collector, current at each collection."""

    def __init__(self, recorder: MetricsRecorder) -> None:
        self._recorder = recorder

    def describe(self) -> list[Metric]:
        # The names the registry checks for clashes, without flushing anything.
        metrics = self._recorder.prometheus_metrics()
        return [family for metric in metrics for family in metric.describe()]

    def collect(self) -> Iterator[Metric]:
        recorder = self._recorder
        recorder.pull()
        for metric in recorder.prometheus_metrics():
            yield from metric.collect()
