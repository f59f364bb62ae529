"""kvtier's metrics as vLLM sees them: metric metadata, and stats as deltas.

vLLM declares an offloading spec's metrics from metadata records and then takes the
spec's stats from ``get_stats()`` as what changed since its last call, histogram
samples included. Used by :mod:`kvtier.integrations.vllm` only: it imports vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload import base as vllm_base

from kvtier.metrics import CounterDef, GaugeDef, HistogramDef, MetricDefinition, MetricsRecorder

__all__ = ["StatsRecorder", "vllm_metric_definitions"]


def vllm_metric_definitions(
    definitions: Mapping[str, MetricDefinition],
) -> dict[str, vllm_base.OffloadingMetricMetadata]:
    """kvtier's metric definitions as vLLM's metadata records, by the same names."""
    out: dict[str, vllm_base.OffloadingMetricMetadata] = {}
    for name, definition in definitions.items():
        if isinstance(definition, HistogramDef):
            out[name] = vllm_base.OffloadingHistogramMetadata(
                documentation=definition.documentation,
                labelnames=definition.labelnames,
                buckets=definition.buckets,
            )
        elif isinstance(definition, GaugeDef):
            out[name] = vllm_base.OffloadingGaugeMetadata(
                documentation=definition.documentation, labelnames=definition.labelnames
            )
        elif isinstance(definition, CounterDef):
            out[name] = vllm_base.OffloadingCounterMetadata(
                documentation=definition.documentation, labelnames=definition.labelnames
            )
        else:
            raise TypeError(f"metric {name!r} has an unknown definition type {definition!r}")
    return out


class StatsRecorder(MetricsRecorder):
    """kvtier's metrics, also collected as vLLM stats until :meth:`take`.

    vLLM wants what changed since its last ``get_stats()`` call, histogram samples
    included, which a Prometheus registry no longer holds; so each recording is also
    added to a pending payload. Tiers record from the tier loop's thread, the manager
    from the scheduler's: a lock keeps the payload whole.
    """

    def __init__(
        self,
        definitions: Mapping[str, MetricDefinition],
        registry: CollectorRegistry | None = None,
    ) -> None:
        super().__init__(definitions, registry)
        self._stats_lock = threading.Lock()
        self._stats = OffloadingConnectorStats()

    def inc(self, name: str, amount: float = 1.0, labels: tuple[str, ...] = ()) -> None:
        super().inc(name, amount, labels)
        if amount and name in self.definitions:
            with self._stats_lock:
                self._stats.increase_counter(name, amount, tuple(labels))

    def set(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        super().set(name, value, labels)
        if name in self.definitions:
            with self._stats_lock:
                self._stats.set_gauge(name, value, tuple(labels))

    def observe(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        super().observe(name, value, labels)
        if name in self.definitions:
            with self._stats_lock:
                self._stats.observe_histogram(name, value, tuple(labels))

    def observe_many(
        self, name: str, values: Iterable[float], labels: tuple[str, ...] = ()
    ) -> None:
        values = list(values)
        super().observe_many(name, values, labels)
        if name in self.definitions and values:
            with self._stats_lock:
                for value in values:
                    self._stats.observe_histogram(name, value, tuple(labels))

    def take(self, *, pull: bool) -> OffloadingConnectorStats | None:
        """What was recorded since the last call; None if nothing was.

        With ``pull``, what the manager counted since its last flush is flushed first.
        """
        if pull:
            self.pull()
        with self._stats_lock:
            stats, self._stats = self._stats, OffloadingConnectorStats()
        return None if stats.is_empty() else stats
