"""Replay a workload through the whole stack and report against the hardware."""

from __future__ import annotations

import asyncio
import contextlib
import math
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from prometheus_client import CollectorRegistry

from kvtier.bench.engine import Engine, copy_engine, device, kv_caches
from kvtier.bench.physical import measure_disk, measure_loopback, measure_memcpy, measure_s3
from kvtier.bench.probe import percentile
from kvtier.bench.replay import Progress, Replay, TimelinePoint, replay
from kvtier.bench.services import local_tiers
from kvtier.bench.settings import MIB, BenchSettings, bench_config
from kvtier.bench.workloads import Workload, WorkloadSize, build_workload
from kvtier.facade import KVTier
from kvtier.metrics import Names
from kvtier.tiers._format import HEADER_BYTES
from kvtier.tiers.base import SecondaryTier

__all__ = ["run_bench"]

# How long the engine waits to hear of a spawned p2p peer's chunks before it starts.
_PEER_INDEX_TIMEOUT_S = 60.0


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


def _active_gbps(
    timeline: list[TimelinePoint], label: str, field_name: Literal["bytes_written", "bytes_read"]
) -> float:
    """Bytes over the time the counter was rising (first to last increase)."""
    points = [
        (p["t"], p["tiers"][label][field_name] if label in p["tiers"] else 0.0) for p in timeline
    ]
    rising = [i for i in range(1, len(points)) if points[i][1] > points[i - 1][1]]
    if not rising:
        return 0.0
    start, end = points[rising[0] - 1][0], points[rising[-1]][0]
    moved = points[rising[-1]][1] - points[rising[0] - 1][1]
    return moved / max(end - start, 1e-9) / 1e9


async def run_bench(
    settings: BenchSettings,
    *,
    progress: Progress | None = None,
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
            async with KVTier(config, caches, registry, engine=copy_engine()) as kv:
                await _hear_of_peer_chunks(kv, local.peer_chunks)
                engine = Engine(kv, caches, gpu_blocks, settings.lookup_timeout_s)
                run = await replay(kv, engine, workload, settings, progress)
                labels = ["0:primary", *kv.manager.tier_labels]
                stats = kv.manager.tier_stats()
                tiers = dict(zip(kv.manager.tier_labels, kv.manager.tiers, strict=True))
            report = _report(settings, workload, run, stats, labels, registry)
            report["duration_s"] = round(run.elapsed_s, 3)
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
    run: Replay,
    stats: dict[str, dict[str, float]],
    labels: list[str],
    registry: CollectorRegistry,
) -> dict[str, Any]:
    chunk = settings.chunk_bytes
    requests, timeline = run.requests, run.timeline
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
            "device": device(),
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
        "loop_lag_ms": _percentiles(run.loop_lags),
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
