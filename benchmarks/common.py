"""What the tier benchmarks share: filling the primary tier, cascading, promoting.

The benchmarks drive a ``TieringOffloadingManager`` the way a scheduler does: stores in
jobs of a few chunks, promotions as requests that look their chunks up step after step
until every one is a hit. The serving-path workload (``serving_path.py`` with kvtier
alone, ``vllm_path.py`` through vLLM's scheduler and connector) shares its arguments,
its chunk patterns, its raw disk limit and its figures from here, so the two measure
the same thing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash

from kvtier import ConfigError, LookupResult, ReqContext, TieringOffloadingManager
from kvtier.bench.busy import BusyHost
from kvtier.bench.physical import DiskLimits, drop_page_cache, measure_disk
from kvtier.bench.probe import LagProbe, percentile
from kvtier.bench.tiers import raw_disk_depths
from kvtier.hosts import Step, step_until
from kvtier.keys import OffloadKey
from kvtier.records import PrepareStoreOutput
from kvtier.tiers.fs import FileSystemTier

__all__ = [
    "GIB",
    "IDLE_WAIT_MS",
    "MIB",
    "FsTierShape",
    "LagProbe",
    "PathRun",
    "Patterns",
    "add_busy_host_arguments",
    "cascade",
    "check_busy_host_arguments",
    "check_workload_args",
    "drop_caches",
    "fill_rows",
    "make_reads_cold",
    "on_loop",
    "percentile",
    "print_json",
    "print_path_summary",
    "promote",
    "raw_disk",
    "rounded",
    "run_in_scratch",
    "tier_options",
    "workload_parser",
]

MIB = 1 << 20
GIB = 1 << 30


def fill_rows(manager: TieringOffloadingManager) -> None:
    """Distinct, incompressible bytes in every slot of the primary tier, before any timing."""
    if manager.region is None:
        return
    rows = manager.region.primary_view
    seed = os.urandom(rows.row_bytes)
    for slot in range(len(rows)):
        rows[slot][:] = seed[slot % 4096 :] + seed[: slot % 4096]


async def cascade(manager: TieringOffloadingManager, keys: Sequence[OffloadKey], job: int) -> float:
    """Seconds to store ``keys`` in jobs of ``job`` and cascade them all to the tiers."""
    started = time.perf_counter()
    for first in range(0, len(keys), job):
        batch, req = list(keys[first : first + job]), ReqContext(f"w{first}")
        room: list[PrepareStoreOutput] = []
        await step_until(manager.host, _store_step(manager, batch, req, room))
        manager.complete_store(room[0].keys_to_store, req)
        manager.on_request_finished(req)
    await manager.drain()
    return time.perf_counter() - started


def _store_step(
    manager: TieringOffloadingManager,
    batch: list[OffloadKey],
    req: ReqContext,
    room: list[PrepareStoreOutput],
) -> Callable[[], Step]:
    """A step that puts the batch's slots into ``room`` once cascades made some."""

    def step() -> Step:
        out = manager.prepare_store(batch, req)
        if out is None:
            manager.on_schedule_end()
            return Step.WAIT
        room.append(out)
        return Step.DONE

    return step


async def promote(
    manager: TieringOffloadingManager,
    keys: Sequence[OffloadKey],
    job: int,
    in_flight: int,
    *,
    tag: str = "r",
    strict: bool = False,
) -> tuple[float, list[float]]:
    """Seconds to promote ``keys`` back, and each request's submit-to-ready latency.

    Each request of ``job`` chunks is one promotion job, ``in_flight`` at once. Every
    key is looked up each step (no short-circuit): the first step's lookups queue the
    whole batch, which goes to the tier as one job. With ``strict``, a miss fails the
    benchmark instead of being retried.
    """
    latencies: list[float] = []
    gate = asyncio.Semaphore(in_flight)

    async def one(first: int) -> None:
        async with gate:
            batch, req = keys[first : first + job], ReqContext(f"{tag}{first}")
            submitted = time.perf_counter()

            def promoted() -> Step:
                results = [manager.lookup(key, req) for key in batch]
                if results.count(LookupResult.HIT) == len(batch):
                    return Step.DONE
                if strict and LookupResult.MISS in results:
                    raise RuntimeError(f"promotion of chunks {first}.. missed")
                manager.on_schedule_end()
                return Step.WAIT

            await step_until(manager.host, promoted)
            latencies.append(time.perf_counter() - submitted)
            manager.on_request_finished(req)

    started = time.perf_counter()
    await asyncio.gather(*(one(first) for first in range(0, len(keys), job)))
    return time.perf_counter() - started, latencies


# ------------------------------------------------------------ the serving-path workload

#: How long an idle scheduler step waits for a tier completion before it steps again
#: (copies do not wake it), unless --idle-ms says otherwise: short next to a 16-chunk
#: job's tens of milliseconds, long enough not to spin on a two-core machine.
IDLE_WAIT_MS = 1.0


def workload_parser(description: str) -> argparse.ArgumentParser:
    """The serving-path workload's arguments: sizes, the fs tier, the page cache."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--root", type=Path, default=None, help="directory on the disk to test")
    parser.add_argument("--gib", type=float, default=4.0, help="GiB of distinct chunks")
    parser.add_argument("--primary-gib", type=float, default=1.0)
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--job-chunks", type=int, default=16, help="chunks per request")
    parser.add_argument("--in-flight", type=int, default=16, help="load requests at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tier-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an fs tier parameter (value as JSON, else a string), e.g. read_depth=8",
    )
    parser.add_argument(
        "--idle-ms",
        type=float,
        default=IDLE_WAIT_MS,
        help="how long a step that found nothing to do waits for a tier completion",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=60.0, help="longest a request may wait for its chunks"
    )
    parser.add_argument(
        "--page-cache",
        choices=("drop", "o_direct"),
        default="drop",
        help="make reads cold by dropping the page cache (as root; else falls back) or "
        "by evicting the tier's files only (the raw reference reads with O_DIRECT "
        "wherever the tier writes with it, either way)",
    )
    add_busy_host_arguments(parser)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, a few seconds, the page cache left alone (a smoke test)",
    )
    return parser


def check_workload_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Apply ``--quick``'s sizes and refuse sizes that cannot run."""
    if args.quick:
        args.gib, args.primary_gib, args.chunk_mib = 0.09375, 1 / 32, 0.25
        args.in_flight = min(args.in_flight, 4)
        # A smoke test on a shared machine must not empty everyone's page cache.
        args.page_cache = "o_direct"
    for name in ("gib", "primary_gib", "chunk_mib", "idle_ms"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("job_chunks", "in_flight"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    check_busy_host_arguments(parser, args)


def add_busy_host_arguments(parser: argparse.ArgumentParser) -> None:
    """``--busy-host`` and ``--busy-threads``: :class:`~kvtier.bench.busy.BusyHost`'s."""
    parser.add_argument(
        "--busy-host",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="threads of this process run Python (holding the GIL) for this share of one "
        "core during the stores and promotions, as a serving engine's scheduler and "
        "workers do (0.5: half a core), the same for every side measured; 0 (the "
        "default): a quiet host",
    )
    parser.add_argument(
        "--busy-threads", type=int, default=2, help="threads the busy host's share is spread over"
    )


def check_busy_host_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a busy host its threads cannot be (one core a thread at most)."""
    if args.busy_threads < 1:
        parser.error("--busy-threads must be at least 1")
    if not 0 <= args.busy_host <= args.busy_threads:
        parser.error("--busy-host must be between 0 and --busy-threads (one core a thread)")


def rounded(value: Any) -> Any:
    """``value`` with every float in it rounded to 4 places, nested ones too."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [rounded(item) for item in value]
    return value


def run_in_scratch(
    run: Callable[[argparse.Namespace, Path], dict[str, Any]],
    args: argparse.Namespace,
    script: str,
) -> dict[str, Any]:
    """``run(args, root)`` in a fresh directory under ``--root``, removed afterwards.

    A bad ``--tier-option`` ends the script with kvtier's message, naming the key,
    without a traceback.
    """
    root = Path(tempfile.mkdtemp(prefix=f"kvtier-{Path(script).stem}-", dir=args.root))
    try:
        return run(args, root)
    except ConfigError as exc:
        raise SystemExit(f"{script}: {exc}") from None
    finally:
        shutil.rmtree(root, ignore_errors=True)


def tier_options(pairs: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--tier-option expects KEY=VALUE, got {pair!r}")
        try:
            options[name] = json.loads(text)
        except json.JSONDecodeError:
            options[name] = text
    return options


def drop_caches() -> bool:
    """Drop the whole page cache after a sync; False where that is not permitted."""
    os.sync()
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        return False
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def cold_read_mode(args: argparse.Namespace) -> str:
    """How reads are made cold in this run: ``dropped`` (the page cache, dropped now
    once) where ``--page-cache drop`` is permitted, else ``o_direct``."""
    return "dropped" if args.page_cache == "drop" and drop_caches() else "o_direct"


def make_reads_cold(mode: str, tier_root: Path) -> None:
    """Evict what the tier wrote: the whole page cache, or its own files only."""
    if mode == "dropped":
        drop_caches()
    else:
        drop_page_cache([path for path in tier_root.rglob("*") if path.is_file()])


class Patterns:
    """What the "model" computes for a chunk: seeded random bytes XORed with its key.

    Every chunk differs from every other in every word, so a chunk served under the
    wrong key, torn, or shifted never compares equal. ``caches`` are int64 views whose
    first dimension is the block.

    Host-memory caches keep an xxh3-64 digest of each key's blocks as :meth:`write`
    fills them, and :meth:`wrong` compares digests: one read of the loaded bytes
    instead of building the pattern again and comparing (measured 0.12 against
    0.4-0.6 ms of the worker's CPU per 2 MiB chunk here). A wrong chunk passes with
    odds of 2**-64. The worker stands for a GPU, whose copies cost the host next to
    nothing: the less CPU its check takes from the tiers beside it, the more the
    figures measure the tiers. Keys written elsewhere, and device caches, are compared
    word by word.
    """

    def __init__(self, caches: Sequence[torch.Tensor], seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.bases = [
            torch.randint(
                -(1 << 62), 1 << 62, cache.shape[1:], dtype=torch.int64, generator=generator
            ).to(cache.device)
            for cache in caches
        ]
        self.caches = caches
        self._digests: dict[bytes, tuple[int, ...]] | None = (
            {} if all(cache.device.type == "cpu" for cache in caches) else None
        )

    @staticmethod
    def value(key: bytes) -> int:
        return int.from_bytes(key[:8], "big", signed=True)

    def write(self, keys: Sequence[bytes], blocks: Sequence[int]) -> None:
        digests = self._digests
        for key, block in zip(keys, blocks, strict=True):
            value = self.value(key)
            for cache, base in zip(self.caches, self.bases, strict=True):
                torch.bitwise_xor(base, value, out=cache[block])
            if digests is not None:
                digests[key] = self._digest(block)

    def wrong(self, keys: Sequence[bytes], blocks: Sequence[int]) -> int:
        """How many of ``keys`` do not hold their pattern in ``blocks``."""
        digests = self._digests or {}
        wrong = 0
        for key, block in zip(keys, blocks, strict=True):
            digest = digests.get(key)
            if digest is not None:
                wrong += self._digest(block) != digest
                continue
            value = self.value(key)
            if not all(
                torch.equal(cache[block] ^ value, base)
                for cache, base in zip(self.caches, self.bases, strict=True)
            ):
                wrong += 1
        return wrong

    def _digest(self, block: int) -> tuple[int, ...]:
        return tuple(xxhash.xxh3_64_intdigest(cache[block].numpy()) for cache in self.caches)


def on_loop(manager: TieringOffloadingManager, fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run the coroutine function ``fn`` on the manager's loop thread and return its result."""
    assert manager.loop is not None
    return asyncio.run_coroutine_threadsafe(fn(), manager.loop.loop).result()


class FsTierShape:
    """How the manager's first secondary tier (the fs tier) does its I/O."""

    def __init__(self, manager: TieringOffloadingManager) -> None:
        fs = manager.tiers[0]
        self.label = manager.diagnostics.tier_labels[0]
        self.direct_write = bool(getattr(fs, "o_direct", False))
        self._fs = fs
        self._settings = getattr(fs, "settings", None)
        self._depths = raw_disk_depths(fs) if isinstance(fs, FileSystemTier) else (1,)

    @property
    def read_depth(self) -> int | str:
        """The read depth for the report: fixed, or where the adaptive one ended."""
        return self._depth("read_depth")

    @property
    def write_depth(self) -> int | str:
        return self._depth("write_depth")

    def _depth(self, name: str) -> int | str:
        now: int = getattr(self._fs, name, 1)
        return now if isinstance(getattr(self._settings, name, 1), int) else f"auto, ended {now}"

    def measure(self, directory: Path, count: int, chunk: int) -> DiskLimits:
        """The raw disk limit (``kvtier bench``'s) for ``count`` chunks of this tier."""
        return measure_disk(directory, count, chunk, depths=self._depths, direct=self.direct_write)


def raw_disk(before: DiskLimits, after: DiskLimits) -> dict[str, float]:
    """The raw limit measured before and after the kvtier phases: the mean of the two."""
    return {
        "raw_read_gbps": statistics.mean([before.read_gbps, after.read_gbps]),
        "raw_write_gbps": statistics.mean([before.write_gbps, after.write_gbps]),
        "raw_read_gbps_before": before.read_gbps,
        "raw_read_gbps_after": after.read_gbps,
        "raw_write_gbps_before": before.write_gbps,
        "raw_write_gbps_after": after.write_gbps,
    }


class PathRun:
    """One serving-path run's measurements, taken the same way by both benchmarks.

    :meth:`begin` takes the raw disk limit and starts the loop-lag probe on the
    manager's loop thread; :meth:`phase` times a phase (wall clock, CPU, the probe's
    samples); :meth:`end` stops the probe and reads the fs tier's counts and job times
    (before the manager shuts down); :meth:`figures` takes the raw limit again and
    returns the figures, by the names both report.
    """

    def __init__(
        self, args: argparse.Namespace, fs: FsTierShape, page_cache: str, device: str
    ) -> None:
        self.args, self.fs, self.page_cache, self.device = args, fs, page_cache, device
        self.probe = LagProbe()
        self.busy = BusyHost(args.busy_host, args.busy_threads)
        self.seconds: dict[str, float] = {}
        #: The process's CPU seconds in each phase, the busy host's threads' taken out.
        self.cpu_s: dict[str, float] = {}
        #: The share of one core the busy host's threads took in each phase.
        self.busy_share: dict[str, float] = {}
        self.fs_stats: dict[str, float] = {}
        self.job_times: list[float] = []
        self._raw_before: DiskLimits | None = None

    def begin(
        self, manager: TieringOffloadingManager, root: Path, chunks: int, chunk_bytes: int
    ) -> None:
        self._raw_before = self.fs.measure(root / "raw-before", chunks, chunk_bytes)
        probe = self.probe

        async def start_probe() -> None:
            probe.start()

        on_loop(manager, start_probe)

    def phase(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, timed as phase ``name`` (``store`` or ``load``), with the busy
        host's threads running beside it (none on a quiet host)."""
        cpu, started = time.process_time(), time.perf_counter()
        self.probe.phase = name
        self.busy.start()
        try:
            return fn(*args)
        finally:
            self.busy_share[name] = self.busy.stop()
            self.probe.phase = None
            self.seconds[name] = time.perf_counter() - started
            self.cpu_s[name] = time.process_time() - cpu - self.busy.cpu_s

    def end(self, manager: TieringOffloadingManager) -> None:
        on_loop(manager, self.probe.stop)
        self.fs_stats = manager.diagnostics.tier_stats()[self.fs.label]
        self.job_times = manager.diagnostics.promotion_job_times()[self.fs.label]

    def figures(
        self, root: Path, chunks: int, chunk_bytes: int, waits: Sequence[float]
    ) -> dict[str, Any]:
        """The figures both benchmarks report; ``waits``: each request's wait (seconds)."""
        assert self._raw_before is not None, "begin() first"
        raw = raw_disk(self._raw_before, self.fs.measure(root / "raw-after", chunks, chunk_bytes))
        raw_read, raw_write = raw["raw_read_gbps"], raw["raw_write_gbps"]
        args, fs, lags = self.args, self.fs, self.probe.by_phase
        total_bytes, job_bytes = chunks * chunk_bytes, args.job_chunks * chunk_bytes
        promotion_gbps = total_bytes / self.seconds["load"] / 1e9
        store_gbps = total_bytes / self.seconds["store"] / 1e9
        both = lags.get("store", []) + lags.get("load", [])
        job_times = self.job_times
        store_cpu_s, load_cpu_s = self.cpu_s["store"], self.cpu_s["load"]
        return {
            "promotion_gbps": promotion_gbps,
            "promotion_ratio": promotion_gbps / raw_read,
            "store_gbps": store_gbps,
            "store_ratio": store_gbps / raw_write,
            "promotion_p50_ms": percentile(job_times, 0.5) * 1e3,
            "promotion_p99_ms": percentile(job_times, 0.99) * 1e3,
            "promotion_p50_budget_ms": 1.5 * job_bytes / (raw_read * 1e9) * 1e3,
            "promotion_p99_budget_ms": 3 * job_bytes / (raw_read * 1e9) * 1e3,
            "request_wait_p50_ms": percentile(waits, 0.5) * 1e3,
            "request_wait_p99_ms": percentile(waits, 0.99) * 1e3,
            "loop_lag_p99_ms": percentile(both, 0.99) * 1e3,
            **raw,
            "page_cache": self.page_cache,
            "busy_host": args.busy_host,
            "busy_share_store": self.busy_share["store"],
            "busy_share_load": self.busy_share["load"],
            "raw_write_o_direct": fs.direct_write,
            "loop_lag_p50_ms": percentile(both, 0.5) * 1e3,
            "loop_lag_store_p99_ms": percentile(lags.get("store", []), 0.99) * 1e3,
            "loop_lag_load_p99_ms": percentile(lags.get("load", []), 0.99) * 1e3,
            "promotion_jobs": len(job_times),
            "integrity_failures": int(self.fs_stats["integrity_failures"]),
            "fs_bytes_read": int(self.fs_stats["bytes_read"]),
            "fs_bytes_written": int(self.fs_stats["bytes_written"]),
            "store_cpu_s": store_cpu_s,
            "load_cpu_s": load_cpu_s,
            "cpu_s_per_gib": (store_cpu_s + load_cpu_s) / (total_bytes / GIB),
            "chunks": chunks,
            "chunk_bytes": chunk_bytes,
            "job_chunks": args.job_chunks,
            "in_flight": args.in_flight,
            "read_depth": fs.read_depth,
            "write_depth": fs.write_depth,
            "device": self.device,
        }


def print_path_summary(figures: dict[str, Any]) -> None:
    """The lines both serving-path benchmarks print: bandwidth, job times, loop lag."""
    print(
        f"  stores      {figures['store_gbps']:6.2f} GB/s   raw pwritev "
        f"{figures['raw_write_gbps']:6.2f} GB/s (before {figures['raw_write_gbps_before']:.2f}, "
        f"after {figures['raw_write_gbps_after']:.2f})   ratio {figures['store_ratio']:.2f}"
    )
    print(
        f"  promotions  {figures['promotion_gbps']:6.2f} GB/s   raw preadv  "
        f"{figures['raw_read_gbps']:6.2f} GB/s (before {figures['raw_read_gbps_before']:.2f}, "
        f"after {figures['raw_read_gbps_after']:.2f})   ratio {figures['promotion_ratio']:.2f}"
    )
    print(
        f"  promotion job time p50 {figures['promotion_p50_ms']:.1f} ms (budget "
        f"{figures['promotion_p50_budget_ms']:.1f}), p99 {figures['promotion_p99_ms']:.1f} ms "
        f"(budget {figures['promotion_p99_budget_ms']:.1f}) over {figures['promotion_jobs']} "
        f"jobs; a request's wait for its chunks p50 {figures['request_wait_p50_ms']:.1f} ms, "
        f"p99 {figures['request_wait_p99_ms']:.1f} ms"
    )
    if figures["busy_host"]:
        print(
            f"  busy host: Python threads took {figures['busy_share_store']:.2f} of a core "
            f"while storing, {figures['busy_share_load']:.2f} while promoting (asked "
            f"{figures['busy_host']:g}); their CPU is not counted below"
        )
    print(
        f"  loop lag p50 {figures['loop_lag_p50_ms']:.2f} ms, p99 "
        f"{figures['loop_lag_p99_ms']:.2f} ms; CPU {figures['store_cpu_s']:.1f} s storing, "
        f"{figures['load_cpu_s']:.1f} s loading"
    )


def print_json(figures: dict[str, Any]) -> None:
    """The last line of a benchmark's output: its figures, floats rounded."""
    print(json.dumps(rounded(figures)))
