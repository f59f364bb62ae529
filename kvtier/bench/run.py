"""Replay a workload through the whole stack, the way a serving engine drives it.

A simulated engine owns a pool of GPU blocks (real CUDA tensors when a GPU is present,
CPU tensors standing in otherwise). For each request it looks the prompt's chunks up,
loads the hits into its blocks (checking every loaded byte against what was stored),
"computes" the rest by writing a pattern derived from each chunk's key, and stores
them: exactly the KVTier calls an async serving stack makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from kvtier.bench.physical import measure_disk, measure_loopback, measure_memcpy, measure_s3
from kvtier.bench.probe import LagProbe, percentile
from kvtier.bench.services import local_tiers
from kvtier.bench.workloads import BenchRequest, Workload, WorkloadSize, build_workload, chain_keys
from kvtier.config import OffloadingConfig
from kvtier.facade import KVTier
from kvtier.keys import OffloadKey
from kvtier.metrics import Names
from kvtier.tiers._format import HEADER_BYTES
from kvtier.tiers.base import SecondaryTier
from kvtier.worker.engines import ThreadedCopyEngine

__all__ = ["BenchSettings", "Engine", "bench_config", "copy_engine", "kv_caches", "run_bench"]

MIB = 1 << 20
# How often the timeline is sampled: fine enough to see a tier warm up, coarse enough
# to cost nothing.
_SAMPLE_INTERVAL_S = 0.5
# How long the engine waits to hear of a spawned p2p peer's chunks before it starts.
_PEER_INDEX_TIMEOUT_S = 60.0


@dataclass
class BenchSettings:
    workload: str = "multi-round-qa"
    tiers: tuple[str, ...] = ("fs",)
    #: Extra ``extra_config`` keys (``--config FILE``), applied over the defaults.
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    chunk_bytes: int = 1 * MIB
    primary_bytes: int = 512 * MIB
    working_set_bytes: int = 2048 * MIB
    max_prompt_chunks: int = 64
    concurrency: int = 8
    duration_s: float = 120.0
    lookup_timeout_s: float = 5.0
    root_dir: Path | None = None
    seed: int = 0

    @property
    def working_set_chunks(self) -> int:
        return max(1, self.working_set_bytes // self.chunk_bytes)


@dataclass
class _RequestStats:
    chunks: int = 0
    hits: int = 0
    stored: int = 0
    wrong_chunks: int = 0
    lookup_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    store_s: list[float] = field(default_factory=list)
    requests: int = 0


class Engine:
    """A serving engine's KV bookkeeping in miniature: a GPU block pool and requests."""

    def __init__(self, kv: KVTier, caches: list[torch.Tensor], blocks: int, timeout: float) -> None:
        self.kv = kv
        self.caches = caches
        self.free = list(range(blocks))
        self.freed = asyncio.Condition()
        self.timeout = timeout
        self.stats = _RequestStats()

    async def serve(self, request: BenchRequest) -> None:
        kv, stats = self.kv, self.stats
        keys = chain_keys(request.blocks)
        bpc = kv.blocks_per_chunk
        blocks = await self._allocate(len(keys) * bpc)
        try:
            started = time.perf_counter()
            hits = await kv.lookup(keys, request.req_id, timeout=self.timeout)
            looked_up = time.perf_counter()
            loaded = await kv.load(keys[:hits], blocks[: hits * bpc], request.req_id)
            copied = time.perf_counter()
            # Checking and "computing" are the GPU's work: off the event loop.
            stats.wrong_chunks += await asyncio.to_thread(self._check, keys[:loaded], blocks, bpc)
            await asyncio.to_thread(self._compute, keys[loaded:], blocks[loaded * bpc :], bpc)
            stored = await kv.store(keys, blocks, request.req_id)
            done = time.perf_counter()
            kv.finish(request.req_id)
        finally:
            await self._release(blocks)
        stats.requests += 1
        stats.chunks += len(keys)
        stats.hits += loaded
        stats.stored += stored
        stats.lookup_s.append(looked_up - started)
        stats.load_s.append(copied - looked_up)
        stats.store_s.append(done - copied)

    async def compute_and_store(self, keys: list[OffloadKey], req_id: str) -> int:
        """Compute ``keys`` (as a prefill would) and store them; how many were stored."""
        bpc = self.kv.blocks_per_chunk
        blocks = await self._allocate(len(keys) * bpc)
        try:
            await asyncio.to_thread(self._compute, keys, blocks, bpc)
            stored = await self.kv.store(keys, blocks, req_id)
            self.kv.finish(req_id)
        finally:
            await self._release(blocks)
        return stored

    def _compute(self, keys: list[OffloadKey], blocks: list[int], bpc: int) -> None:
        """Prefill stand-in: every block of a chunk holds a value derived from its key."""
        for i, key in enumerate(keys):
            for cache in self.caches:
                cache[blocks[i * bpc : (i + 1) * bpc]] = _seed(key)

    def _check(self, keys: list[OffloadKey], blocks: list[int], bpc: int) -> int:
        """How many loaded chunks differ from what their key's computation wrote."""
        wrong = 0
        for i, key in enumerate(keys):
            expected = _seed(key)
            chunk = blocks[i * bpc : (i + 1) * bpc]
            if any(not bool((cache[chunk] == expected).all()) for cache in self.caches):
                wrong += 1
        return wrong

    async def _allocate(self, count: int) -> list[int]:
        async with self.freed:
            await self.freed.wait_for(lambda: len(self.free) >= count)
            taken, self.free = self.free[:count], self.free[count:]
        return taken

    async def _release(self, blocks: list[int]) -> None:
        async with self.freed:
            self.free.extend(blocks)
            self.freed.notify_all()


def _seed(key: OffloadKey) -> int:
    return int.from_bytes(key[:8], "big", signed=True)


def bench_config(
    settings: BenchSettings, tiers: list[dict[str, Any]], *, role: str = "bench"
) -> OffloadingConfig:
    """The engine's configuration: ``tiers`` as its secondary tiers, then ``--config``."""
    extra: dict[str, Any] = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": settings.primary_bytes,
        "secondary_tiers": tiers,
    }
    extra.update(settings.extra_config)
    return OffloadingConfig(
        engine_id=f"{role}-{uuid.uuid4().hex[:10]}",
        kv_bytes_per_block=settings.chunk_bytes,
        tokens_per_block=16,
        model_name="kvtier-bench",
        kv_dtype="int64",
        extra_config=extra,
    )


def copy_engine() -> ThreadedCopyEngine | None:
    """The copy engine: the default next to a GPU, else background copy threads.

    Without a GPU, copies run on threads as they would on a GPU's copy streams, so the
    event loop is as free as it would be next to a real device.
    """
    return None if torch.cuda.is_available() else ThreadedCopyEngine()


def kv_caches(settings: BenchSettings, blocks: int) -> list[torch.Tensor]:
    """K and V tensors of this rank: CUDA when present, else CPU standing in."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    per_half = settings.chunk_bytes // 2 // 8
    return [torch.zeros((blocks, per_half), dtype=torch.int64, device=device) for _ in range(2)]


def _histogram_quantile(
    registry: CollectorRegistry, name: str, labels: Mapping[str, str], q: float
) -> float | None:
    """Upper bound of the bucket holding quantile ``q`` of a Prometheus histogram."""
    buckets: list[tuple[float, float]] = []
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name != f"{name}_bucket":
                continue
            if any(sample.labels.get(k) != v for k, v in labels.items()):
                continue
            buckets.append((float(sample.labels["le"]), sample.value))
    if not buckets:
        return None
    buckets.sort()
    total = buckets[-1][1]
    if total == 0:
        return None
    for bound, count in buckets:
        if count >= q * total:
            return bound
    return math.inf


async def _sample(
    kv: KVTier, engine: Engine, timeline: list[dict[str, Any]], stop: asyncio.Event
) -> None:
    started = time.perf_counter()
    while True:
        kv.manager.on_schedule_end()  # flushes counters, like an engine step
        stats = kv.manager.tier_stats()
        timeline.append(
            {
                "t": round(time.perf_counter() - started, 3),
                "requests": engine.stats.requests,
                "chunks": engine.stats.chunks,
                "hits": engine.stats.hits,
                "tiers": {
                    label: {"bytes_written": s["bytes_written"], "bytes_read": s["bytes_read"]}
                    for label, s in stats.items()
                },
            }
        )
        if stop.is_set():
            return
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            await asyncio.wait_for(stop.wait(), _SAMPLE_INTERVAL_S)


def _active_gbps(timeline: list[dict[str, Any]], label: str, field_name: str) -> float:
    """Bytes over the time the counter was rising (first to last increase)."""
    points: list[tuple[float, float]] = [
        (float(p["t"]), float(p["tiers"].get(label, {}).get(field_name, 0.0))) for p in timeline
    ]
    rising = [i for i in range(1, len(points)) if points[i][1] > points[i - 1][1]]
    if not rising:
        return 0.0
    start, end = points[rising[0] - 1][0], points[rising[-1]][0]
    moved = points[rising[-1]][1] - points[rising[0] - 1][1]
    return moved / max(end - start, 1e-9) / 1e9


async def _replay(
    kv: KVTier,
    engine: Engine,
    workload: Workload,
    settings: BenchSettings,
    progress: Callable[[int, int, int], None] | None,
) -> None:
    deadline = time.monotonic() + settings.duration_s
    gate = asyncio.Semaphore(settings.concurrency)
    total = workload.requests

    async def one(request: BenchRequest) -> None:
        async with gate:
            if time.monotonic() > deadline:
                return
            await engine.serve(request)
            if progress is not None:
                progress(engine.stats.requests, total, engine.stats.hits)

    for wave in workload.waves:
        if time.monotonic() > deadline:
            break
        if wave.reset_primary:
            await kv.drain()
            await kv.reset()
        await asyncio.gather(*(one(request) for request in wave.requests))
    await kv.drain()


async def run_bench(
    settings: BenchSettings,
    *,
    progress: Callable[[int, int, int], None] | None = None,
    registry: CollectorRegistry | None = None,
) -> dict[str, Any]:
    """Run ``settings.workload`` and return the report (see ``kvtier bench --json``)."""
    workload = build_workload(
        settings.workload,
        WorkloadSize(settings.working_set_chunks, settings.max_prompt_chunks, settings.seed),
    )
    registry = registry if registry is not None else CollectorRegistry()
    # A secondary_tiers list of the user's own replaces what --tiers would start.
    names = () if "secondary_tiers" in settings.extra_config else settings.tiers
    with _workspace(settings.root_dir) as root:
        async with local_tiers(names, settings, root) as local:
            config = bench_config(settings, local.tiers)
            gpu_blocks = settings.max_prompt_chunks * (settings.concurrency + 1)
            caches = kv_caches(settings, gpu_blocks)
            timeline: list[dict[str, Any]] = []
            probe = LagProbe()
            stop = asyncio.Event()
            async with KVTier(config, caches, registry, engine=copy_engine()) as kv:
                await _hear_of_peer_chunks(kv, local.peer_chunks)
                started = time.perf_counter()
                engine = Engine(kv, caches, gpu_blocks, settings.lookup_timeout_s)
                probe.start()
                sampler = asyncio.ensure_future(_sample(kv, engine, timeline, stop))
                try:
                    await _replay(kv, engine, workload, settings, progress)
                finally:
                    stop.set()
                    await asyncio.gather(sampler, probe.stop())
                elapsed = time.perf_counter() - started
                labels = ["0:primary", *kv.manager.tier_labels]
                stats = kv.manager.tier_stats()
                tiers = dict(zip(kv.manager.tier_labels, kv.manager.tiers, strict=True))
            report = _report(
                settings, workload, engine.stats, stats, labels, timeline, probe, registry
            )
            report["duration_s"] = round(elapsed, 3)
            report["physical"], report["ratios"] = await _physical(settings, root, report, tiers)
    return report


async def _hear_of_peer_chunks(kv: KVTier, chunks: int) -> None:
    """Wait (a while) until the p2p tiers have heard of the spawned peer's chunks."""
    from kvtier.tiers.p2p import PeerTier

    peers = [tier for tier in kv.manager.tiers if isinstance(tier, PeerTier)]
    deadline = time.monotonic() + _PEER_INDEX_TIMEOUT_S
    while peers and sum(t.indexed_keys for t in peers) < chunks:
        if time.monotonic() > deadline:
            return  # the run shows what the peer's index held: fewer p2p hits
        await asyncio.sleep(0.05)


@contextlib.contextmanager
def _workspace(root_dir: Path | None) -> Iterator[Path]:
    if root_dir is not None:
        root_dir.mkdir(parents=True, exist_ok=True)
        yield root_dir
        return
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as directory:
        yield Path(directory)


def _report(
    settings: BenchSettings,
    workload: Workload,
    requests: _RequestStats,
    stats: dict[str, dict[str, float]],
    labels: list[str],
    timeline: list[dict[str, Any]],
    probe: LagProbe,
    registry: CollectorRegistry,
) -> dict[str, Any]:
    chunk = settings.chunk_bytes
    tiers = []
    for label in labels:
        counts = stats.get(label, {})
        queries, hits = counts.get("queries", 0.0), counts.get("hits", 0.0)
        written: float
        read: float
        write_gbps: float | None
        read_gbps: float | None
        promotion: tuple[float | None, ...]
        if label == "0:primary":
            written, read = requests.stored * chunk, requests.hits * chunk
            write_gbps = read_gbps = None
            promotion = (None, None)
        else:
            written, read = counts.get("bytes_written", 0.0), counts.get("bytes_read", 0.0)
            write_gbps = _active_gbps(timeline, label, "bytes_written")
            read_gbps = _active_gbps(timeline, label, "bytes_read")
            promotion = tuple(
                _histogram_quantile(registry, Names.PROMOTION_LATENCY, {"tier": label}, q)
                for q in (0.5, 0.99)
            )
        tiers.append(
            {
                "name": label,
                "queries": int(queries),
                "hits": int(hits),
                "hit_rate": hits / queries if queries else 0.0,
                "bytes_written": int(written),
                "bytes_read": int(read),
                "write_gbps": write_gbps,
                "read_gbps": read_gbps,
                "promotion_ms": {"p50": _ms(promotion[0]), "p99": _ms(promotion[1])},
                "stores_dropped": int(counts.get("stores_dropped", 0.0)),
                "integrity_failures": int(counts.get("integrity_failures", 0.0)),
            }
        )
    return {
        "workload": workload.name,
        "description": workload.description,
        "settings": {
            "chunk_bytes": chunk,
            "primary_bytes": settings.primary_bytes,
            "working_set_bytes": workload.unique_chunks * chunk,
            "concurrency": settings.concurrency,
            "tiers": [label.split(":", 1)[1] for label in labels[1:]],
            "device": "cuda" if torch.cuda.is_available() else "cpu",
        },
        "requests": {
            "count": requests.requests,
            "chunks": requests.chunks,
            "chunk_hit_rate": requests.hits / requests.chunks if requests.chunks else 0.0,
            "wrong_chunks": requests.wrong_chunks,
            "lookup_ms": _percentiles(requests.lookup_s),
            "load_ms": _percentiles(requests.load_s),
            "store_ms": _percentiles(requests.store_s),
        },
        "tiers": tiers,
        "loop_lag_ms": _percentiles(probe.lags),
        "timeline": timeline,
    }


async def _physical(
    settings: BenchSettings,
    root: Path,
    report: dict[str, Any],
    tiers: Mapping[str, SecondaryTier],
) -> tuple[dict[str, float], dict[str, float | None]]:
    """The limits each tier of the run is held against, measured now, and the ratios.

    Each is measured with as many chunks as the tier moved (16 at least, 1 GiB at the
    most; 512 MiB for S3), so the same bytes meet the same hardware. Ratios are None
    where the run moved nothing that way (no-reuse never reads back).
    """
    from kvtier.tiers.fs import FileSystemTier
    from kvtier.tiers.p2p import PeerTier
    from kvtier.tiers.s3 import S3Tier

    chunk = settings.chunk_bytes
    physical = {"memcpy_gbps": round(await asyncio.to_thread(measure_memcpy), 3)}
    ratios: dict[str, float | None] = {}
    entries = {entry["name"]: entry for entry in report["tiers"]}

    def chunks(moved: int, cap: int) -> int:
        return int(max(16, min(moved // chunk, cap // chunk)))

    for label, tier in tiers.items():
        entry = entries[label]
        moved = max(entry["bytes_written"], entry["bytes_read"])
        if isinstance(tier, FileSystemTier) and "fs_write" not in ratios:
            disk = await asyncio.to_thread(
                measure_disk,
                root / "physical",
                chunks(entry["bytes_written"], 1 << 30),
                chunk,
                direct=tier.o_direct,
            )
            physical["disk_write_gbps"] = round(disk.write_gbps, 3)
            physical["disk_read_gbps"] = round(disk.read_gbps, 3)
            ratios["fs_write"] = _ratio(entry["write_gbps"], disk.write_gbps)
            ratios["fs_read"] = _ratio(entry["read_gbps"], disk.read_gbps)
        elif isinstance(tier, S3Tier) and "s3_write" not in ratios:
            async with tier.open_client() as client:
                s3 = await measure_s3(
                    client,
                    tier.bucket,
                    f"{tier.prefix}/kvtier-physical".lstrip("/"),
                    chunks(moved, 512 * MIB),
                    HEADER_BYTES + chunk,
                    tier.max_concurrency,
                )
            physical["s3_put_gbps"] = round(s3.write_gbps, 3)
            physical["s3_get_gbps"] = round(s3.read_gbps, 3)
            ratios["s3_write"] = _ratio(entry["write_gbps"], s3.write_gbps)
            ratios["s3_read"] = _ratio(entry["read_gbps"], s3.read_gbps)
        elif isinstance(tier, PeerTier) and "p2p_read" not in ratios:
            tcp = await asyncio.to_thread(
                measure_loopback, chunks(entry["bytes_read"], 1 << 30), chunk
            )
            physical["tcp_loopback_gbps"] = round(tcp, 3)
            ratios["p2p_read"] = _ratio(entry["read_gbps"], tcp)
    return physical, ratios


def _ratio(measured: float | None, limit: float) -> float | None:
    return round(measured / limit, 3) if measured and limit else None


def _percentiles(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(values, 0.5) * 1e3, 3),
        "p99": round(percentile(values, 0.99) * 1e3, 3),
    }


def _ms(seconds: float | None) -> float | None:
    if seconds is None or math.isinf(seconds):
        return None
    return round(seconds * 1e3, 3)


def settings_dict(settings: BenchSettings) -> dict[str, Any]:
    data = asdict(settings)
    data["root_dir"] = str(settings.root_dir) if settings.root_dir else None
    return data
