"""Driving a workload through KVTier: waves of concurrent requests, a timeline of the
tiers' counters sampled meanwhile, and what the requests took."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

from kvtier.bench.engine import Engine, ServedRequest
from kvtier.bench.probe import LagProbe
from kvtier.bench.settings import BenchSettings
from kvtier.bench.workloads import BenchRequest, Workload
from kvtier.facade import KVTier

__all__ = [
    "SAMPLE_INTERVAL_S",
    "Progress",
    "Replay",
    "RequestStats",
    "TierBytes",
    "TimelinePoint",
    "replay",
]

# How often the timeline is sampled: fine enough to see a tier warm up, coarse enough
# to cost nothing.
SAMPLE_INTERVAL_S = 0.5

#: Called after each request: requests done, requests in the workload, chunks hit so far.
Progress = Callable[[int, int, int], None]


class TierBytes(TypedDict):
    bytes_written: float
    bytes_read: float


class TimelinePoint(TypedDict):
    """The counters at one moment of the run (seconds ``t`` after it started)."""

    t: float
    #: Requests finished so far.
    requests: int
    #: Requests being served at this moment (started, not finished).
    in_flight: int
    chunks: int
    hits: int
    #: By tier label.
    tiers: dict[str, TierBytes]


@dataclass
class RequestStats:
    """What the served requests add up to."""

    requests: int = 0
    chunks: int = 0
    hits: int = 0
    stored: int = 0
    wrong_chunks: int = 0
    #: Requests started and not finished yet (the timeline samples it).
    in_flight: int = 0
    lookup_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    store_s: list[float] = field(default_factory=list)

    def add(self, served: ServedRequest) -> None:
        self.requests += 1
        self.chunks += served.chunks
        self.hits += served.hits
        self.stored += served.stored
        self.wrong_chunks += served.wrong_chunks
        self.lookup_s.append(served.lookup_s)
        self.load_s.append(served.load_s)
        self.store_s.append(served.store_s)


@dataclass(frozen=True)
class Replay:
    """One replayed workload: request totals, the timeline, and the loop's lags."""

    requests: RequestStats
    timeline: list[TimelinePoint]
    #: How late a 1 ms timer fired, seconds, sampled throughout.
    loop_lags: list[float]
    elapsed_s: float


async def replay(
    kv: KVTier,
    engine: Engine,
    workload: Workload,
    settings: BenchSettings,
    progress: Progress | None = None,
) -> Replay:
    """Serve ``workload`` through ``engine`` until done or ``settings.duration_s`` is up.

    Waves run one after another, up to ``settings.concurrency`` requests of a wave at
    once; the cascades still running at the end are waited for.
    """
    stats = RequestStats()
    timeline: list[TimelinePoint] = []
    probe = LagProbe()
    stop = asyncio.Event()
    started = time.perf_counter()
    probe.start()
    sampler = asyncio.ensure_future(_sample(kv, stats, timeline, stop))
    try:
        await _serve_waves(kv, engine, stats, workload, settings, progress)
    finally:
        stop.set()
        await asyncio.gather(sampler, probe.stop())
    return Replay(stats, timeline, probe.lags, time.perf_counter() - started)


async def _serve_waves(
    kv: KVTier,
    engine: Engine,
    stats: RequestStats,
    workload: Workload,
    settings: BenchSettings,
    progress: Progress | None,
) -> None:
    deadline = time.monotonic() + settings.duration_s
    gate = asyncio.Semaphore(settings.concurrency)
    total = workload.requests

    async def one(request: BenchRequest) -> None:
        async with gate:
            if time.monotonic() > deadline:
                return
            stats.in_flight += 1
            try:
                served = await engine.serve(request)
            finally:
                stats.in_flight -= 1
            stats.add(served)
            if progress is not None:
                progress(stats.requests, total, stats.hits)

    for wave in workload.waves:
        if time.monotonic() > deadline:
            break
        if wave.reset_primary:
            await kv.drain()
            await kv.reset()
        await asyncio.gather(*(one(request) for request in wave.requests))
    await kv.drain()


async def _sample(
    kv: KVTier, stats: RequestStats, timeline: list[TimelinePoint], stop: asyncio.Event
) -> None:
    started = time.perf_counter()
    while True:
        kv.manager.on_schedule_end()  # flushes counters, like an engine step
        counts = kv.manager.diagnostics.tier_stats()
        timeline.append(
            {
                "t": round(time.perf_counter() - started, 3),
                "requests": stats.requests,
                "in_flight": stats.in_flight,
                "chunks": stats.chunks,
                "hits": stats.hits,
                "tiers": {
                    label: {"bytes_written": c["bytes_written"], "bytes_read": c["bytes_read"]}
                    for label, c in counts.items()
                },
            }
        )
        if stop.is_set():
            return
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_INTERVAL_S)
