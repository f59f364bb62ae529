"""A plug-in tier whose behaviour tests script: gates, failures, partial loads.

It is a real :class:`SecondaryTier` (the framework runs it exactly like a built-in
tier) that keeps chunks in memory, like the example tier, and lets a test hold its
coroutines at a gate, make them raise, or lose chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import anyio

from kvtier import JobResult, SecondaryTier, TierContext, TransferJob
from kvtier.keys import OffloadKey
from kvtier.records import EventLog, Medium, OffloadingEvent


class ScriptedTier(SecondaryTier):
    """In-memory tier with knobs. ``instances`` keeps every tier built, by name."""

    medium = Medium.STORAGE
    instances: ClassVar[dict[str, ScriptedTier]] = {}

    def __init__(self, ctx: TierContext, **params: Any) -> None:
        super().__init__(ctx)
        settings = ctx.read(params)
        self.name: str = settings.string("tag", ctx.tier_name)
        #: Answer lookups from memory (True) or only through the async lookup (False).
        self.instant: bool = settings.boolean("instant", False)
        self.fail_start: bool = settings.boolean("fail_start", False)
        self.fail_close: bool = settings.boolean("fail_close", False)
        #: Seconds every load takes before it touches a slot: a tier of known latency.
        self.load_delay_s: float = settings.number("load_delay_s", 0.0, minimum=0)
        settings.reject_unknown()
        self.chunks: dict[OffloadKey, bytes] = {}
        self.events = EventLog(ctx.enable_events)
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_stores = False
        self.fail_loads = False
        self.fail_clear = False
        #: Whether clear() ran to its end (past the gate).
        self.cleared = False
        self.lose_on_load: set[OffloadKey] = set()
        self.ignore_cancel = False
        self.lookup_calls: list[tuple[OffloadKey, ...]] = []
        self.load_jobs: list[TransferJob] = []
        self.store_jobs: list[TransferJob] = []
        self.finished_requests: list[str] = []
        self.removed_from_primary: list[OffloadKey] = []
        self.started = False
        self.closed = False
        #: How many times the framework closed it (once, however often its owner is).
        self.closes = 0
        ScriptedTier.instances[self.name] = self

    async def start(self) -> None:
        if self.fail_start:
            raise RuntimeError(f"tier {self.name} refuses to start")
        self.started = True

    def contains(self, key: OffloadKey) -> bool | None:
        return (key in self.chunks) if self.instant else None

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        self.lookup_calls.append(tuple(keys))
        await self._pass_gate()
        return [key in self.chunks for key in keys]

    async def store(self, job: TransferJob) -> JobResult:
        self.store_jobs.append(job)
        await self._pass_gate()
        if self.fail_stores:
            raise OSError(5, "scripted store failure")
        view = self.ctx.primary_view
        for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
            self.chunks[key] = bytes(view[chunk_id])
        self.events.add(job.keys, self.medium, False, self.ctx.tier_name)
        return JobResult(job.job_id, True)

    async def load(self, job: TransferJob) -> JobResult:
        self.load_jobs.append(job)
        await self._pass_gate()
        if self.load_delay_s:
            await asyncio.sleep(self.load_delay_s)
        if self.fail_loads:
            raise OSError(5, "scripted load failure")
        view = self.ctx.primary_view
        loaded = []
        for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
            if key in self.lose_on_load or key not in self.chunks:
                continue
            view[chunk_id][:] = self.chunks[key]
            loaded.append(key)
        return JobResult(job.job_id, len(loaded) == len(job.keys), successful_keys=loaded)

    async def clear(self) -> bool:
        await self._pass_gate()
        if self.fail_clear:
            raise OSError(5, "scripted clear failure")
        for key in list(self.chunks):
            del self.chunks[key]
        self.cleared = True
        return True

    def on_request_finished(self, req_id: str) -> None:
        self.finished_requests.append(req_id)

    def on_primary_removed(self, keys: Sequence[OffloadKey]) -> None:
        self.removed_from_primary.extend(keys)

    def take_events(self) -> list[OffloadingEvent]:
        return self.events.take()

    async def aclose(self) -> None:
        self.closed = True
        self.closes += 1
        if self.fail_close:
            raise OSError(5, f"tier {self.name} fails to close")

    async def _pass_gate(self) -> None:
        if self.ignore_cancel:
            # Like a thread that cannot be interrupted: finish waiting even if cancelled.
            while not self.gate.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(self.gate.wait())
            return
        await self.gate.wait()

    @classmethod
    def build_metric_definitions(cls, tier_config: Mapping[str, Any]) -> dict[str, Any]:
        return {}


class ScriptedSharingTier(ScriptedTier):
    """A :class:`ScriptedTier` that, like p2p, keeps no copies of its own: what it
    stored is not a copy that outlives the primary tier's."""

    keeps_copies = False


class ThreadWritingTier(SecondaryTier):
    """A plugin tier that loads through ``anyio.to_thread.run_sync``, as documented.

    Its load thread waits for ``release`` (a test holds it as long as it likes), then
    writes the chunk into the slot: a thread the framework cannot interrupt.
    """

    medium = Medium.STORAGE
    instances: ClassVar[dict[str, ThreadWritingTier]] = {}

    def __init__(self, ctx: TierContext, tag: str) -> None:
        super().__init__(ctx)
        self.chunks: dict[OffloadKey, bytes] = {}
        self.release = threading.Event()
        self.release.set()
        self.writes_done = 0
        ThreadWritingTier.instances[tag] = self

    def contains(self, key: OffloadKey) -> bool | None:
        return key in self.chunks

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        return [key in self.chunks for key in keys]

    async def store(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
            self.chunks[key] = bytes(view[chunk_id])
        return JobResult(job.job_id, True)

    async def load(self, job: TransferJob) -> JobResult:
        await anyio.to_thread.run_sync(self._write, job)
        return JobResult(job.job_id, True)

    def _write(self, job: TransferJob) -> None:
        self.release.wait()
        view = self.ctx.primary_view
        for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
            view[chunk_id][:] = self.chunks[key]
        self.writes_done += 1
