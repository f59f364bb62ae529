"""The example tier: chunks kept in a dictionary of this process, framed and verified.

The smallest complete tier: its parameters are a frozen dataclass, it is built from
them, it answers lookups, copies bytes out of pinned primary slots on ``store`` and
into allocated slots on ``load``, frames each chunk with :mod:`kvtier.format` and
verifies it before it reports it loaded, and reports events. Everything else (tasks,
concurrency, timeouts, failures, metrics, back-pressure) is the framework's. For a
tier that talks to a server, start from :mod:`kvtier.tiers.memcached` instead.

Configuration::

    {"type": "example", "custom_param": 67}
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.format import HEADER_BYTES, ChunkFormat
from kvtier.keys import OffloadKey
from kvtier.metrics import CounterDef, MetricDefinition
from kvtier.records import Medium, OffloadingEvent
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob
from kvtier.tiers.kit import ConfigReader, CorruptChunks, EventLog, ThrottledLog

__all__ = ["ExampleSettings", "ExampleTier"]

logger = logging.getLogger(__name__)

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
    """Keeps each chunk as ``bytes`` (header + row) in a dictionary (no capacity limit)."""

    medium = Medium.CPU  # so its hits are reported as host memory
    settings_class = ExampleSettings

    def __init__(self, ctx: TierContext, settings: ExampleSettings | None = None) -> None:
        super().__init__(ctx)
        self.settings = settings or ExampleSettings()
        self._format = ChunkFormat(ctx.namespace)
        #: key -> the stored chunk: its header, then its row.
        self.chunks: dict[OffloadKey, bytes] = {}
        self._events = EventLog(ctx.enable_events)
        log = ThrottledLog(logger, f"tier {ctx.tier_name}")
        self._corrupt = CorruptChunks(ctx, log, lambda key: f"chunk {key.hex()} in memory")

    @classmethod
    def build_metric_definitions(cls, settings: Any) -> dict[str, MetricDefinition]:
        return {STORED_CHUNKS: CounterDef("Chunks the example tier stored.", ("tier",))}

    def contains(self, key: OffloadKey) -> bool | None:
        # A dictionary probe is instant, so the scheduler never has to retry.
        return key in self.chunks

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        return [key in self.chunks for key in keys]

    async def store(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        stored = []
        for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
            if key not in self.chunks:
                row = view[chunk_id]
                self.chunks[key] = bytes(self._format.header(key, row)) + bytes(row)
                stored.append(key)
        if stored:
            self._events.add(stored, self.medium, False, self.ctx.tier_name)
            self.ctx.metrics.inc(STORED_CHUNKS, len(stored), (self.ctx.tier_name,))
        return JobResult(job.job_id, True)

    async def load(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        loaded = []
        corrupt: dict[OffloadKey, str] = {}
        for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
            chunk = self.chunks.get(key)
            if chunk is None:
                continue
            row = view[chunk_id]
            stored = memoryview(chunk)
            if len(stored) != HEADER_BYTES + len(row):
                corrupt[key] = "wrong length"
                continue
            row[:] = stored[HEADER_BYTES:]
            # The bytes in the slot are served only once they match the header.
            problem = self._format.verify(stored[:HEADER_BYTES], key, row)
            if problem is None:
                loaded.append(key)
            else:
                corrupt[key] = problem
        await self._corrupt.discard(corrupt, f"promotion job {job.job_id}", self._remove)
        return JobResult(job.job_id, len(loaded) == len(job.keys), successful_keys=loaded)

    async def _remove(self, keys: Sequence[OffloadKey]) -> Sequence[OffloadKey]:
        for key in keys:
            self.forget(key)
        return keys

    def take_events(self) -> list[OffloadingEvent]:
        return self._events.take()

    async def clear(self) -> bool:
        if self.chunks:
            self._events.add(list(self.chunks), self.medium, True, self.ctx.tier_name)
            self.chunks.clear()
        return True

    def forget(self, key: OffloadKey) -> None:
        """Drop one chunk (tests use this to make a tier lose data)."""
        if self.chunks.pop(key, None) is not None:
            self._events.add([key], self.medium, True, self.ctx.tier_name)
