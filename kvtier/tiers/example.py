"""The example tier: an in-memory dictionary, and the model for writing a tier.

Copy this file to start a tier of your own. Everything a tier must do is here: declare
its parameters as a frozen dataclass, answer lookups, copy bytes out of pinned primary
slots on ``store`` and into allocated slots on ``load``, and report events. Everything
else (tasks, concurrency, timeouts, failures, metrics, back-pressure) is the
framework's.

Configuration::

    {"type": "example", "custom_param": 67}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.config import ConfigReader
from kvtier.keys import OffloadKey
from kvtier.metrics import CounterDef, MetricDefinition
from kvtier.records import EventLog, Medium, OffloadingEvent
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob

__all__ = ["ExampleSettings", "ExampleTier"]

STORED_CHUNKS = "kvtier_example_stored_chunks"


@dataclass(frozen=True)
class ExampleSettings:
    """The example tier's parameters: one field per key, each documented here.

    :meth:`from_params` is all the checking a configuration gets before anything is
    built, so it reads every key, names a bad one by its path and opens nothing.
    """

    #: An integer that does nothing but show how a parameter is read and checked (0).
    custom_param: int = 0

    @classmethod
    def from_params(cls, params: Mapping[str, Any], path: str) -> ExampleSettings:
        reader = ConfigReader(params, path)
        custom_param = reader.integer("custom_param", 0)
        reader.reject_unknown()  # a misspelt key is an error, never a silent default
        return cls(custom_param=custom_param)


class ExampleTier(SecondaryTier):
    """Keeps chunks as ``bytes`` in a dictionary (no capacity limit)."""

    medium = Medium.CPU
    settings_class = ExampleSettings

    def __init__(self, ctx: TierContext, **params: Any) -> None:
        super().__init__(ctx)
        self.settings = ExampleSettings.from_params(params, ctx.config_path)
        self._chunks: dict[OffloadKey, bytes] = {}
        self._events = EventLog(ctx.enable_events)

    @classmethod
    def build_metric_definitions(
        cls, tier_config: Mapping[str, Any]
    ) -> dict[str, MetricDefinition]:
        return {STORED_CHUNKS: CounterDef("Chunks the example tier stored.", ("tier",))}

    def contains(self, key: OffloadKey) -> bool | None:
        # A dictionary probe is instant, so the scheduler never has to retry.
        return key in self._chunks

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        return [key in self._chunks for key in keys]

    async def store(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        stored = []
        for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
            if key not in self._chunks:
                self._chunks[key] = bytes(view[chunk_id])
                stored.append(key)
        if stored:
            self._events.add(stored, self.medium, False, self.ctx.tier_name)
            self.ctx.metrics.inc(STORED_CHUNKS, len(stored), (self.ctx.tier_name,))
        return JobResult(job.job_id, True)

    async def load(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        loaded = []
        for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
            chunk = self._chunks.get(key)
            if chunk is not None:
                view[chunk_id][:] = chunk
                loaded.append(key)
        return JobResult(job.job_id, len(loaded) == len(job.keys), successful_keys=loaded)

    def take_events(self) -> list[OffloadingEvent]:
        return self._events.take()

    async def clear(self) -> bool:
        if self._chunks:
            self._events.add(list(self._chunks), self.medium, True, self.ctx.tier_name)
            self._chunks.clear()
        return True

    def forget(self, key: OffloadKey) -> None:
        """Drop one chunk (tests use this to make a tier lose data)."""
        if self._chunks.pop(key, None) is not None:
            self._events.add([key], self.medium, True, self.ctx.tier_name)
