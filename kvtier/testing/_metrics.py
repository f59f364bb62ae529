"""The framework's metrics a contract test reads, and how it reads them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

__all__ = ["LATE_COMPLETIONS", "QUARANTINED_SLOTS", "has_metric", "metric_value"]

#: The framework's gauge of primary slots held back from reuse because a timed-out
#: job's I/O may still touch them.
QUARANTINED_SLOTS = "kvtier_tiering_quarantined_slots"
#: The framework's counter of timed-out jobs whose I/O ended after their time-out.
LATE_COMPLETIONS = "kvtier_tiering_late_completions"


def metric_value(registry: CollectorRegistry, name: str, tier: str | None = None) -> float | None:
    """The sum of ``name``'s samples (a counter's name ends in ``_total``); None if none.

    Samples labelled with another ``tier`` than ``tier`` are left out. Collecting the
    registry makes kvtier flush its counts first.
    """
    total: float | None = None
    for family in registry.collect():
        for sample in family.samples:
            if sample.name != name:
                continue
            label = sample.labels.get("tier")
            if tier is not None and label is not None and label != tier:
                continue
            total = (total or 0.0) + sample.value
    return total


def has_metric(registry: CollectorRegistry, family: str) -> bool:
    """Whether the registry declares a metric family (a counter's without ``_total``)."""
    return any(metric.name == family for metric in registry.collect())
