"""A plugin tier that does its I/O in threads it does not wait for when cancelled.

A real :class:`SecondaryTier` that keeps chunks in memory, like the example tier, but
copies every chunk in a thread started with ``loop.run_in_executor``, which it leaves
running when its coroutine is cancelled: a plugin that does not cooperate with the
framework's time-outs. What guards a slot against such a thread is the framework's,
not the tier's: the thread holds a memoryview it got from ``ctx.primary_view``.

:meth:`LateThreadTier.hold_next` holds the next load or store thread before it touches
its slot, until the test lets it go (see ``tests/tiers/test_contract_plugin.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from kvtier import JobResult, SecondaryTier, TierContext, TransferJob
from kvtier.keys import OffloadKey
from kvtier.records import EventLog, Medium, OffloadingEvent
from kvtier.testing import Stall

# A held thread gives up after this long, so that a test that never lets it go
# cannot leave a thread behind forever.
HOLD_LIMIT_S = 60.0


class _Hold:
    """One held thread: where it is (the :class:`Stall`) and what lets it go."""

    def __init__(self) -> None:
        self.stall = Stall()
        self.release = threading.Event()


class LateThreadTier(SecondaryTier):
    """In-memory chunks, copied in threads nobody waits for. ``instances`` by tag."""

    medium = Medium.STORAGE
    instances: ClassVar[dict[str, LateThreadTier]] = {}

    def __init__(self, ctx: TierContext, **params: Any) -> None:
        super().__init__(ctx)
        settings = ctx.read(params)
        tag = settings.string("tag", ctx.tier_name)
        settings.reject_unknown()
        self._chunks: dict[OffloadKey, bytes] = {}
        self._lock = threading.Lock()
        self._events = EventLog(ctx.enable_events)
        self._holds: dict[str, _Hold] = {}
        LateThreadTier.instances[tag] = self

    @contextlib.contextmanager
    def hold_next(self, kind: str) -> Iterator[Stall]:
        """Hold the next ``"load"`` or ``"store"`` thread before it touches its slot."""
        hold = self._holds[kind] = _Hold()
        try:
            yield hold.stall
        finally:
            self._holds.pop(kind, None)
            hold.release.set()

    def contains(self, key: OffloadKey) -> bool | None:
        with self._lock:
            return key in self._chunks

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        with self._lock:
            return [key in self._chunks for key in keys]

    async def store(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        rows = [view[chunk_id] for chunk_id in job.chunk_ids]
        hold = self._holds.pop("store", None)
        loop = asyncio.get_running_loop()
        # Not awaited to its end when cancelled: the thread goes on reading the rows.
        await loop.run_in_executor(None, self._copy_out, job.keys, rows, hold)
        self._events.add(job.keys, self.medium, False, self.ctx.tier_name)
        return JobResult(job.job_id, True)

    async def load(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        rows = [view[chunk_id] for chunk_id in job.chunk_ids]
        hold = self._holds.pop("load", None)
        loop = asyncio.get_running_loop()
        # Not awaited to its end when cancelled: the thread goes on writing the rows.
        loaded = await loop.run_in_executor(None, self._copy_in, job.keys, rows, hold)
        return JobResult(job.job_id, len(loaded) == len(job.keys), successful_keys=loaded)

    def _copy_out(
        self, keys: Sequence[OffloadKey], rows: list[memoryview], hold: _Hold | None
    ) -> None:
        _wait(hold)
        try:
            copies = [bytes(row) for row in rows]
            with self._lock:
                self._chunks.update(zip(keys, copies, strict=True))
        finally:
            rows.clear()
            if hold is not None:
                hold.stall.finish()

    def _copy_in(
        self, keys: Sequence[OffloadKey], rows: list[memoryview], hold: _Hold | None
    ) -> list[OffloadKey]:
        _wait(hold)
        loaded = []
        try:
            for key, row in zip(keys, rows, strict=True):
                with self._lock:
                    chunk = self._chunks.get(key)
                if chunk is not None:
                    row[:] = chunk
                    loaded.append(key)
        finally:
            rows.clear()
            if hold is not None:
                hold.stall.finish()
        return loaded

    def stored(self, key: OffloadKey) -> bytes | None:
        """The bytes held under ``key``, or None."""
        with self._lock:
            return self._chunks.get(key)

    def take_events(self) -> list[OffloadingEvent]:
        return self._events.take()


def _wait(hold: _Hold | None) -> None:
    if hold is not None:
        hold.stall.reach()
        hold.release.wait(HOLD_LIMIT_S)
