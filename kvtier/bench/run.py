"""Replay a workload through the whole stack and report against the hardware."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kvtier.bench.engine import Engine, copy_engine, device, kv_caches
from kvtier.bench.physical import measure_disk, measure_loopback, measure_memcpy, measure_s3
from kvtier.bench.replay import Progress, replay
from kvtier.bench.report import PRIMARY, build_report
from kvtier.bench.services import local_tiers
from kvtier.bench.settings import MIB, BenchSettings, bench_config
from kvtier.bench.workloads import WorkloadSize, build_workload
from kvtier.facade import KVTier
from kvtier.tiers._format import HEADER_BYTES
from kvtier.tiers.base import SecondaryTier

__all__ = ["run_bench"]

# How long the engine waits to hear of a spawned p2p peer's chunks before it starts.
_PEER_INDEX_TIMEOUT_S = 60.0


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
                labels = [PRIMARY, *kv.manager.tier_labels]
                stats = kv.manager.tier_stats()
                tiers = dict(zip(kv.manager.tier_labels, kv.manager.tiers, strict=True))
            report = build_report(settings, workload, run, stats, labels, registry, device())
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
