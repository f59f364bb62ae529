"""vLLM 0.33's own tiering beside kvtier's, on the same scheduler-driven workload.

Both backends are built the way vLLM builds one, through vLLM's ``OffloadingSpecFactory``
from the same ``OffloadingConfig``: vLLM's ``TieringOffloadingSpec`` and kvtier's
``KVTierOffloadingSpec`` (``spec_module_path``), each with a CPU primary tier of
``--primary-gib`` and one fs tier at its defaults (``{"type": "fs", "root_dir": ...}``).
The same driver then works each one's scheduler-side manager through vLLM's
``OffloadingManager`` interface, as vLLM's connector does: every step's calls in one hold
of ``manager.lock``, ended by ``on_schedule_end``, then ``get_stats``. A worker thread
does the copies as plain memory copies between a host "GPU" buffer and the manager's
primary-tier rows (vLLM's own worker needs CUDA), and checks every loaded chunk's bytes.
The runs alternate (vLLM, kvtier, vLLM, kvtier, ...), ``--runs`` of each, each in a fresh
directory, so that the disk's drift falls on both alike; the table shows the medians.
Where the disk has room, every run's files and the raw reference's stay until the end
(``files_kept``): on ext4 without a journal, a file created soon after many were removed
costs CPU for each of them, and removals between runs would fall on whichever side ran
next.

1. Raw reference: ``kvtier.bench.physical.measure_disk`` over as many one-chunk files as
   the workload stores, spread over subdirectories as the tiers spread theirs, the best
   of 1, 4, ``--raw-threads`` and twice that many threads writing them and reading them
   back cold, with O_DIRECT where the filesystem takes it.
2. Each run, stores: ``--data-gib`` of distinct chunks, each holding a pattern derived
   from its key, as requests of ``--job-chunks`` chunks, one new request per step
   (``on_new_request``, ``prepare_store``, the worker's copy, ``complete_store``); the
   clock runs until the manager has no pending work (every file written to the fs
   tier) and ``os.sync()`` returned.
3. Each run, promotions: the primary tier emptied (``reset_cache``, ``on_reset_flushed``)
   and the page cache evicted, the requests come back in a seeded random order,
   ``--in-flight`` at once. Each step looks up every key of every waiting request; a
   request whose keys are all HIT is pinned (``prepare_load``), copied out and checked
   by the worker, then ``complete_load`` and ``on_request_finished``. A request's wait
   runs from its admission until the lookups found every chunk readable; its ready
   time until the worker's copy of it is done, what a request actually waits for
   before its prefill. Sixteen requests held at once are a closed loop: a request not
   waiting for its promotions waits in the worker's queue, so the wait alone shows
   which of the two stages held the queue as much as how fast either was.
4. Each run, the scheduler call rates on a primary tier alone (``benchmarks/scheduler.py``'s
   measure): lookup hits and one-chunk store cycles per second, under the lock, the
   fastest of :data:`RATE_ROUNDS` rounds.
5. The raw reference again; the limit is the mean of the two.

Each run also reads the chunk files its tier promoted from, just after the promotions,
evicted from the page cache, at the raw reference's thread counts (the best of them):
the same files from the same place at the same moment. A virtual disk may serve files
written minutes before from its host's cache, which the reference's own files (written
at the start and the end) do not see alike; against this read, a promotion ratio above
1 would mean the tier beat the disk itself (``<side>_promotion_own_ratio``, the median
of the runs' ratios, and ``<side>_own_files_read_gbps``).

A busy host (``--busy-host SHARE``): a serving engine's scheduler and worker threads run
Python in the same process as its offloading backend and hold the GIL while they do,
which an idle benchmark process hides. With ``--busy-host 0.5``, ``--busy-threads``
threads (:class:`kvtier.bench.busy.BusyHost`) run pure Python for half of one core
between them, in 10 ms turns, throughout each side's stores and promotions, the same
for both sides; their measured share is reported (``<side>_busy_share_store`` /
``_load``) and their CPU time is taken out of the CPU figures.

CPU time is the whole process's (``getrusage``, every thread) over a phase, per GiB
stored or promoted; it includes the worker thread's copies and checks, the same work
for both. kvtier's fs tier also takes a checksum of every chunk it writes, which vLLM's
does not: ``checksum_cpu_s_per_gib`` is that pass alone
(:func:`kvtier.bench.physical.measure_checksum`, on bytes out of the CPU's caches), and
``store_cpu_s_per_gib_allowed`` vLLM's CPU per GiB stored plus it. The loop lag is
kvtier's (an event-loop probe on its tier loop, every :data:`PROBE_INTERVAL_S`); vLLM
has no event loop.

The page cache is dropped before each phase where this process may; elsewhere every
file under the tier's directory is evicted with ``posix_fadvise(DONTNEED)``. vLLM's fs
tier prefers its C extension ``vllm.fs_io_C``, which a CPU-only torch cannot load as
built (it names CUDA libraries it uses nothing from): empty stand-ins under those names
are loaded first, and the output says which I/O path vLLM's fs tier took.

The last line is one JSON object (also written to ``--json``): each figure of each side
(``vllm_store_gbps``, ``kvtier_store_gbps``, ``..._promotion_gbps``,
``..._request_wait_p50_ms`` / ``_p99_ms``, ``..._request_ready_p50_ms`` / ``_p99_ms``,
``..._lookup_hit_ops_s``, ``..._store_cycle_ops_s``, ``..._store_cpu_s_per_gib`` /
``_load_cpu_s_per_gib``,
``..._mismatches``, ``kvtier_loop_lag_p99_ms``), ``ratio_<figure>`` (kvtier over vLLM),
``raw_*`` and ``<side>_store_ratio`` / ``<side>_promotion_ratio`` against it,
``page_cache``, ``vllm_io_path``, ``figures`` (each figure's name, label and format, for
other reports to print), and each run's figures under ``vllm_runs`` /
``kvtier_runs``.

    .nox/vllm/bin/python benchmarks/vs_vllm.py --root /path/on/the/disk/to/measure
    .nox/vllm/bin/python benchmarks/vs_vllm.py --root /path --busy-host 0.5   # a busy host
    .nox/vllm/bin/python benchmarks/vs_vllm.py --quick     # small sizes; seconds after
                                                           # importing vLLM
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import common
import torch
from serving_path import Copy, CopyThread, Scheduler, Waiting
from vllm_offline import offloading_config

from kvtier.bench import physical
from kvtier.bench.busy import BusyHost
from kvtier.format import HEADER_BYTES
from kvtier.records import TransferResult

# Importing vLLM compiles a few kernels with torch, which warns about its own
# deprecations (and the test suite turns warnings into errors).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import (
        LookupResult,
        OffloadKey,
        ReqContext,
        ScheduleEndContext,
        make_offload_key,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics

SIDES = ("vllm", "kvtier")
LABELS = {"vllm": "vLLM", "kvtier": "kvtier"}
#: How each side's spec is named in ``kv_connector_extra_config``.
SPEC_NAMES: dict[str, dict[str, str]] = {
    "vllm": {"spec_name": "TieringOffloadingSpec"},
    "kvtier": {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm"},
}
TOKENS_PER_BLOCK = 16
#: Rounds of the scheduler call rates; the fastest counts.
RATE_ROUNDS = 5
#: The loop-lag probe's timer on kvtier's tier loop. At 1 ms its thousand wake-ups a
#: second took about 0.2 CPU-seconds of a 3-second phase and the GIL from the I/O
#: threads beside it, charged to kvtier's side; at 10 ms it costs a tenth of that and
#: still sees any stall longer than a tick.
PROBE_INTERVAL_S = 0.01
#: Libraries ``vllm/fs_io_C.abi3.so`` lists as needed but takes no symbol from (a CUDA
#: torch ships them, a CPU one does not).
CUDA_ONLY_LIBRARIES = ("libc10_cuda.so", "libtorch_cuda.so", "libnvrtc.so.13")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=None, help="directory on the disk to test")
    parser.add_argument("--data-gib", type=float, default=4.0, help="GiB of distinct chunks")
    parser.add_argument("--primary-gib", type=float, default=1.0)
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--job-chunks", type=int, default=16, help="chunks per request")
    parser.add_argument("--in-flight", type=int, default=16, help="load requests at once")
    parser.add_argument("--runs", type=int, default=3, help="runs of each side, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--raw-threads", type=int, default=16)
    parser.add_argument("--lookups", type=int, default=2_000_000)
    parser.add_argument("--store-cycles", type=int, default=300_000)
    parser.add_argument("--stored", type=int, default=100_000, help="chunks for the call rates")
    parser.add_argument(
        "--idle-ms",
        type=float,
        default=common.IDLE_WAIT_MS,
        help="how long a step that moved nothing sleeps before the next",
    )
    parser.add_argument("--timeout-s", type=float, default=120.0, help="longest a request may wait")
    parser.add_argument(
        "--page-cache",
        choices=("drop", "fadvise"),
        default="drop",
        help="drop the whole page cache before each phase (falls back to fadvise where "
        "not permitted), or evict the tier's files only",
    )
    common.add_busy_host_arguments(parser)
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    parser.add_argument(
        "--tier-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a parameter of kvtier's fs tier (JSON value), e.g. write_depth=4; repeatable "
        "(the table is then no longer at kvtier's defaults)",
    )
    parser.add_argument(
        "--sides",
        type=lambda text: [side for side in SIDES if side in text.split(",")],
        default=list(SIDES),
        help="which sides run: vllm,kvtier (both); one alone to profile it",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, one run each, the page cache left alone (a smoke test)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.data_gib, args.primary_gib, args.chunk_mib = 0.03, 1 / 64, 0.25
        args.job_chunks, args.in_flight, args.runs = 4, 2, 1
        args.lookups, args.store_cycles, args.stored = 20_000, 5_000, 5_000
        # A smoke test on a shared machine must not empty everyone's page cache.
        args.page_cache = "fadvise"
    for name in ("data_gib", "primary_gib", "chunk_mib", "idle_ms", "timeout_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("job_chunks", "in_flight", "runs", "raw_threads", "lookups", "store_cycles"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    common.check_busy_host_arguments(parser, args)
    chunk = int(args.chunk_mib * common.MIB)
    if chunk % 4096:
        parser.error("--chunk-mib must be a whole number of 4 KiB pages")
    args.chunk_bytes = chunk
    args.requests = int(args.data_gib * common.GIB) // chunk // args.job_chunks
    if args.requests < 1:
        parser.error("--data-gib holds less than one request of --job-chunks chunks")
    # Every request in flight has its chunks pinned in the primary tier at once.
    if int(args.primary_gib * common.GIB) // chunk < args.in_flight * args.job_chunks:
        parser.error("--primary-gib must hold --in-flight requests of --job-chunks chunks")
    return args


# ------------------------------------------------------------------ vLLM's fs I/O path


def load_fs_io_extension() -> str:
    """Let ``vllm.fs_io_C`` import under a CPU-only torch; what happened, in words.

    Empty shared objects named after the CUDA libraries it lists (and never calls) are
    loaded globally first, so the dynamic loader finds them by name. A torch that has
    the real ones needs none of that.
    """
    try:
        import vllm.fs_io_C
    except ImportError:
        pass
    else:
        return "loaded"
    compiler = shutil.which("cc")
    if compiler is None:
        return "not loaded: no C compiler (cc) to build stand-ins for its CUDA libraries"
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "empty.c"
        source.write_text("")
        for name in CUDA_ONLY_LIBRARIES:
            library = Path(scratch) / name
            built = subprocess.run(
                [
                    compiler,
                    "-shared",
                    "-fPIC",
                    f"-Wl,-soname,{name}",
                    "-o",
                    str(library),
                    str(source),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if built.returncode != 0:
                return f"not loaded: cc failed to build {name}: {built.stderr.strip()}"
            ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    try:
        import vllm.fs_io_C  # noqa: F401
    except ImportError as exc:
        return f"not loaded: {exc}"
    return "loaded with empty stand-ins for its CUDA libraries"


def vllm_io_path() -> str:
    """Which I/O vLLM's fs tier does, as its modules decided when they were imported."""
    from vllm.v1.kv_offload.tiering.fs import io, manager

    if io._HAS_FSIO_C and manager._HAS_BATCH_LOOKUP_C:
        return "C extension (vllm.fs_io_C)"
    if io._HAS_FSIO_C or manager._HAS_BATCH_LOOKUP_C:
        return "C extension for part (vllm.fs_io_C), Python for the rest"
    return "pure Python"


# -------------------------------------------------------------------- the two sides


def create_spec(name: str, chunk_bytes: int, primary_bytes: int, tiers: list[Any]) -> Any:
    """``name``'s spec, as vLLM's connector creates it."""
    extra = {**SPEC_NAMES[name], "cpu_bytes_to_use": primary_bytes, "secondary_tiers": tiers}
    engine_id = f"bench-vs-{name}-{uuid.uuid4().hex[:8]}"
    config = offloading_config(
        engine_id,
        extra,
        worker_kv_bytes_per_block=chunk_bytes,
        tokens_per_block=TOKENS_PER_BLOCK,
        model="bench",
    )
    return OffloadingSpecFactory.create_spec(config)


class Side:
    """One backend's scheduler-side manager, its primary rows, and its fs tier's counts."""

    name = ""

    def __init__(self, args: argparse.Namespace, tier_root: Path) -> None:
        primary = int(args.primary_gib * common.GIB)
        tier = self.fs_tier(args, tier_root)
        self.spec = create_spec(self.name, args.chunk_bytes, primary, [tier])
        self.manager: Any = self.spec.get_manager()

    def fs_tier(self, args: argparse.Namespace, tier_root: Path) -> dict[str, Any]:
        """The side's fs tier: at its defaults."""
        return {"type": "fs", "root_dir": str(tier_root)}

    def row(self, slot: int) -> memoryview:
        """The primary tier's row ``slot``, writable."""
        raise NotImplementedError

    def fs_bytes_read(self, stats: OffloadingConnectorStats) -> int:
        """Bytes the fs tier has read into the primary tier so far, by its own count;
        ``stats``: everything ``get_stats`` returned so far."""
        raise NotImplementedError

    def fs_shape(self) -> dict[str, Any]:
        """How the fs tier does its I/O: O_DIRECT, how many reads and writes at once."""
        raise NotImplementedError

    def phase(self, name: str | None) -> None:
        """The workload's phase from now on (``store``, ``load``, or None between)."""

    def loop_lag_p99_ms(self) -> float | None:
        """The p99 of an event-loop probe's lag over the phases, where there is a loop."""
        return None

    def close(self) -> None:
        self.manager.shutdown()


class VllmSide(Side):
    """vLLM's ``TieringOffloadingSpec``: rows of the primary tier's shared memory view."""

    name = "vllm"

    def __init__(self, args: argparse.Namespace, tier_root: Path) -> None:
        super().__init__(args, tier_root)
        view = self.manager.primary_tier.get_kv_memoryview()
        assert view.strides is not None
        self._stride = view.strides[0]
        # A 2-D memoryview hands out no rows; its flat bytes can be sliced.
        self._flat: memoryview | None = view.cast("B")

    def row(self, slot: int) -> memoryview:
        assert self._flat is not None
        return self._flat[slot * self._stride : (slot + 1) * self._stride]

    def fs_bytes_read(self, stats: OffloadingConnectorStats) -> int:
        _, values = stats.metric_sections()
        return int(sum(values.get(TieringOffloadingMetrics.READ_BYTES, {}).values()))

    def fs_shape(self) -> dict[str, Any]:
        fs = self.manager.secondary_tiers[0]
        # Its pool's threads are named ..._l<i> (reads first) and ..._s<i> (writes first).
        kinds = [thread.name.rsplit("_", 1)[-1][0] for thread in fs._pool._threads]
        return {
            "o_direct": bool(fs._use_o_direct),
            "read_threads": kinds.count("l"),
            "write_threads": kinds.count("s"),
        }

    def close(self) -> None:
        # The region's mapping cannot close while a view of it is exported.
        if self._flat is not None:
            self._flat.release()
            self._flat = None
        super().close()


class KvtierSide(Side):
    """kvtier's ``KVTierOffloadingSpec``: rows of kvtier's region, handed out one by one."""

    name = "kvtier"

    def fs_tier(self, args: argparse.Namespace, tier_root: Path) -> dict[str, Any]:
        """At its defaults, but for what ``--tier-option`` sets."""
        return {**super().fs_tier(args, tier_root), **common.tier_options(args.tier_option)}

    def __init__(self, args: argparse.Namespace, tier_root: Path) -> None:
        super().__init__(args, tier_root)
        self.kvtier = self.manager.kvtier
        assert self.kvtier.region is not None
        self._rows = self.kvtier.region.primary_view
        self.probe = common.LagProbe(PROBE_INTERVAL_S)
        self.probe.phase = None
        probe = self.probe

        async def start() -> None:
            probe.start()

        common.on_loop(self.kvtier, start)

    def row(self, slot: int) -> memoryview:
        # kvtier tracks every row handed out until it is dropped: take it per copy.
        row: memoryview = self._rows[slot]
        return row

    def fs_bytes_read(self, stats: OffloadingConnectorStats) -> int:
        fs = common.FsTierShape(self.kvtier)
        return int(self.kvtier.diagnostics.tier_stats()[fs.label]["bytes_read"])

    def fs_shape(self) -> dict[str, Any]:
        fs = common.FsTierShape(self.kvtier)
        return {
            "o_direct": fs.direct_write,
            "read_depth": fs.read_depth,
            "write_depth": fs.write_depth,
        }

    def phase(self, name: str | None) -> None:
        self.probe.phase = name

    def loop_lag_p99_ms(self) -> float:
        lags = self.probe.by_phase
        return common.percentile(lags.get("store", []) + lags.get("load", []), 0.99) * 1e3

    def close(self) -> None:
        try:
            common.on_loop(self.kvtier, self.probe.stop)
        finally:
            super().close()


SIDE_CLASSES: dict[str, type[Side]] = {"vllm": VllmSide, "kvtier": KvtierSide}


class RowCopier:
    """The worker's copies: memory copies between the "GPU" buffer and primary rows.

    ``serving_path.CopyThread`` runs it on its worker thread; a copy is done when
    ``submit_*`` returns. The same for both sides.
    """

    def __init__(self, gpu: torch.Tensor, row: Callable[[int], memoryview]) -> None:
        self.gpu = gpu
        self.row = row
        self._finished: list[TransferResult] = []

    def _row(self, slot: int) -> torch.Tensor:
        words = self.gpu.shape[1]
        return torch.frombuffer(self.row(int(slot)), dtype=torch.int64, count=words)

    def submit_store(self, job_id: int, blocks: Sequence[int], chunk_ids: Sequence[int]) -> None:
        started = time.perf_counter()
        for block, slot in zip(blocks, chunk_ids, strict=True):
            self._row(slot).copy_(self.gpu[block])
        self._done(job_id, len(blocks), started)

    def submit_load(self, job_id: int, chunk_ids: Sequence[int], blocks: Sequence[int]) -> None:
        started = time.perf_counter()
        for slot, block in zip(chunk_ids, blocks, strict=True):
            self.gpu[block].copy_(self._row(slot))
        self._done(job_id, len(blocks), started)

    def _done(self, job_id: int, count: int, started: float) -> None:
        size = count * self.gpu.shape[1] * 8
        self._finished.append(TransferResult(job_id, True, size, time.perf_counter() - started))

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished


# ------------------------------------------------------------------------ the driver


@dataclass
class Figures:
    waits: list[float] = field(default_factory=list)
    #: Per request, admission to its chunks copied into the worker's memory.
    ready: list[float] = field(default_factory=list)
    mismatches: int = 0
    copy_failures: int = 0
    lookup_misses: int = 0
    steps: int = 0


class Driver(Scheduler):
    """The scheduler's side, through vLLM's ``OffloadingManager`` interface.

    Each step holds ``manager.lock`` once for its manager calls (as vLLM's connector
    holds it from its first lookup to ``on_schedule_end``), then asks ``get_stats`` in
    a hold of its own, as vLLM's scheduler does each step. The copies go to the worker
    thread and come back as serving_path.py's scheduler sends and takes them.
    """

    def __init__(self, side: Side, copier: CopyThread, args: argparse.Namespace) -> None:
        super().__init__(
            side.manager,
            copier,
            args.job_chunks,
            args.in_flight,
            args.timeout_s,
            args.idle_ms / 1e3,
        )
        self.side = side
        self.figures = Figures()
        self.stats = OffloadingConnectorStats()
        #: When each load request was admitted, until its copy is done.
        self._admitted: dict[str, float] = {}

    def store_all(self, requests: Sequence[list[OffloadKey]]) -> None:
        """Store ``requests``, one new one per step, until every file is on the fs tier."""
        manager = self.manager
        pending = deque(enumerate(requests))
        # Two groups of blocks: the next request's copy may start while one finishes.
        free = deque(range(self.in_flight, self.in_flight + 2))
        head: tuple[ReqContext, float] | None = None
        while pending or len(free) < 2:
            stored: list[str] = []
            with manager.lock:
                progressed = self._take_copies(free)
                if pending and free:
                    index, keys = pending[0]
                    if head is None:
                        head = ReqContext(f"store-{index}"), time.perf_counter()
                        manager.on_new_request(head[0])
                    req, since = head
                    out = manager.prepare_store(keys, req)
                    if out is not None:
                        pending.popleft()
                        head, progressed = None, True
                        stored.append(req.req_id)
                        self._store(req, out, free)
                    elif time.perf_counter() - since > self.timeout_s:
                        raise RuntimeError(
                            f"{req.req_id}: the primary tier refused its chunks for "
                            f"{self.timeout_s:g} s"
                        )
                manager.on_schedule_end(ScheduleEndContext(stored, ()))
            self._end_step(progressed)
        while True:
            with manager.lock:
                if not manager.has_pending_work():
                    break
                manager.on_schedule_end(ScheduleEndContext((), ()))
            self._end_step(False)
        os.sync()

    def _store(self, req: ReqContext, out: Any, free: deque[int]) -> None:
        keys = list(out.keys_to_store)
        if not keys:  # every chunk was there already: nothing to copy
            self.manager.on_request_finished(req)
            return
        group = free.popleft()
        blocks = self.blocks_of(group)[: len(keys)]
        self._send(True, req, keys, blocks, list(out.store_spec.chunk_ids), group)

    def load_all(self, requests: Sequence[list[OffloadKey]]) -> None:
        """Bring ``requests`` back, ``in_flight`` at once, each once all its chunks are HIT."""
        manager = self.manager
        pending = deque(enumerate(requests))
        free = deque(range(self.in_flight))
        waiting: list[Waiting] = []
        while pending or waiting or len(free) < self.in_flight:
            started: list[str] = []
            with manager.lock:
                progressed = self._take_copies(free)
                while pending and free:
                    index, keys = pending.popleft()
                    req = ReqContext(f"load-{index}")
                    manager.on_new_request(req)
                    admitted = self._admitted[req.req_id] = time.perf_counter()
                    waiting.append(Waiting(req, keys, free.popleft(), admitted))
                waiting = [entry for entry in waiting if not self._try_load(entry, started)]
                manager.on_schedule_end(ScheduleEndContext(started, ()))
            self._end_step(progressed or bool(started))

    def _try_load(self, entry: Waiting, started: list[str]) -> bool:
        """Look every key of ``entry`` up; start its load if all are HIT."""
        lookup, req = self.manager.lookup, entry.req
        results = [lookup(key, req) for key in entry.keys]
        now = time.perf_counter()
        hits = results.count(LookupResult.HIT)
        if hits == len(results):
            self.figures.waits.append(now - entry.admitted)
            slots = list(self.manager.prepare_load(entry.keys, req).chunk_ids)
            blocks = self.blocks_of(entry.group)[: len(entry.keys)]
            self._send(False, req, entry.keys, blocks, slots, entry.group)
            started.append(req.req_id)
            return True
        self.figures.lookup_misses += results.count(LookupResult.MISS)
        if now - entry.admitted > self.timeout_s:
            raise RuntimeError(
                f"{req.req_id} still has {len(results) - hits} of {len(results)} chunks "
                f"unreadable after {self.timeout_s:g} s"
            )
        return False

    def loaded(self, copy: Copy) -> None:
        admitted = self._admitted.pop(copy.req.req_id)
        self.figures.ready.append(time.perf_counter() - admitted)

    def _end_step(self, progressed: bool) -> None:
        with self.manager.lock:
            stats = self.manager.get_stats()
        if stats is not None:
            self.stats.aggregate(stats)
        self.figures.steps += 1
        if not progressed:
            # What a model step would take; neither backend is woken by its tiers.
            time.sleep(self.idle_s)


# --------------------------------------------------------------------------- a run


def chunk_keys(tag: str, count: int) -> list[OffloadKey]:
    """``count`` distinct keys of group 0, as vLLM makes them from block hashes."""
    return [
        make_offload_key(hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=16).digest(), 0)
        for i in range(count)
    ]


def cpu_seconds() -> float:
    """This process's CPU time so far, every thread's."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def thread_cpu_seconds() -> dict[int, float]:
    """CPU time so far of each thread of this process, by native thread id.

    The scheduler's own count (``schedstat``, nanoseconds) where the kernel keeps it: the
    ``stat`` file's user and system times are sampled in clock ticks, and summed over a
    few dozen threads in a phase of a second or two they missed up to a fifth of it.
    """
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            try:
                seconds[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
            except FileNotFoundError:
                # Fields after the command name (which may hold spaces): utime, stime are
                # the 12th and 13th of them.
                fields = (task / "stat").read_text().rpartition(")")[2].split()
                seconds[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return seconds


def thread_kind(name: str) -> str:
    """A thread's name without its pool index: one row per pool."""
    return re.sub(r"[-_ ]?\d+$", "", re.sub(r"[-_]\d+_\d+$", "", name)) or name


@dataclass
class Phase:
    seconds: float
    #: The process's CPU seconds, the busy host's threads' taken out.
    cpu_s: float
    #: CPU seconds by kind of thread (its name, pool index dropped); ``exited``: threads
    #: that ended during the phase.
    cpu_by_thread: dict[str, float]
    #: The share of one core the busy host's threads took (0 on a quiet host).
    busy_share: float = 0.0


def timed(side: Side, name: str, busy: BusyHost, fn: Callable[..., None], *args: Any) -> Phase:
    """``fn(*args)`` as the workload's phase ``name``, with ``busy``'s threads running
    beside it: wall clock and CPU time, theirs apart."""
    side.phase(name)
    before = thread_cpu_seconds()
    cpu, started = cpu_seconds(), time.perf_counter()
    busy.start()
    try:
        fn(*args)
    finally:
        busy_share = busy.stop()
        side.phase(None)
    seconds, cpu_s = time.perf_counter() - started, cpu_seconds() - cpu - busy.cpu_s
    after = thread_cpu_seconds()
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    by_kind: dict[str, float] = {}
    for tid, total in after.items():
        kind = thread_kind(names.get(tid, "native"))
        by_kind[kind] = by_kind.get(kind, 0.0) + total - before.get(tid, 0.0)
    by_kind["exited"] = cpu_s - sum(by_kind.values())
    by_thread = {k: round(v, 3) for k, v in by_kind.items() if v >= 0.005}
    return Phase(seconds, cpu_s, by_thread, busy_share)


def page_cache_mode(args: argparse.Namespace) -> str:
    """``drop_caches`` where this process may drop the page cache, else ``fadvise``."""
    return "drop_caches" if args.page_cache == "drop" and common.drop_caches() else "fadvise"


def make_cold(mode: str, tier_root: Path) -> None:
    """Before a phase: the whole page cache dropped, or the tier's files evicted."""
    common.make_reads_cold("dropped" if mode == "drop_caches" else "o_direct", tier_root)


def chunk_files(tier_root: Path, chunk_bytes: int) -> list[Path]:
    """Files under ``tier_root`` big enough to hold a chunk."""
    return [
        path
        for path in tier_root.rglob("*")
        if path.is_file() and path.stat().st_size >= chunk_bytes
    ]


def run_once(
    name: str,
    args: argparse.Namespace,
    root: Path,
    requests: Sequence[list[OffloadKey]],
    patterns: common.Patterns,
    page_cache: str,
    direct: bool,
    keep: bool,
) -> dict[str, Any]:
    """One run of side ``name`` in ``root``: stores, promotions, a raw read of the files
    it promoted from, then the call rates. Its files are removed after it unless
    ``keep`` (see :func:`room_to_keep`)."""
    tier_root = root / "tier"
    root.mkdir()  # kvtier's fs tier creates its root_dir, not the parents
    side = SIDE_CLASSES[name](args, tier_root)
    copier = CopyThread(RowCopier(patterns.caches[0], side.row), patterns)  # type: ignore[arg-type]
    copier.start()
    driver = Driver(side, copier, args)
    total = len(requests) * args.job_chunks * args.chunk_bytes
    try:
        make_cold(page_cache, tier_root)
        busy = BusyHost(args.busy_host, args.busy_threads)
        store = timed(side, "store", busy, driver.store_all, requests)
        with side.manager.lock:
            side.manager.reset_cache()
            side.manager.on_reset_flushed()  # no copy was in flight
        files = chunk_files(tier_root, args.chunk_bytes)
        make_cold(page_cache, tier_root)
        order = list(requests)
        random.Random(args.seed).shuffle(order)
        read_before = side.fs_bytes_read(driver.stats)
        load = timed(side, "load", busy, driver.load_all, order)
        promoted = side.fs_bytes_read(driver.stats) - read_before
        lag = side.loop_lag_p99_ms()
        fs = side.fs_shape()
        # The files the promotions read, cold again, at the reference's depths.
        own_read = physical.measure_reads(files, depths=raw_depths(args.raw_threads), direct=direct)
    finally:
        copier.inbox.put(None)
        copier.join()
        side.close()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    figures = driver.figures
    return {
        "store_gbps": total / store.seconds / 1e9,
        "promotion_gbps": promoted / load.seconds / 1e9,
        "request_wait_p50_ms": common.percentile(figures.waits, 0.5) * 1e3,
        "request_wait_p99_ms": common.percentile(figures.waits, 0.99) * 1e3,
        "request_ready_p50_ms": common.percentile(figures.ready, 0.5) * 1e3,
        "request_ready_p99_ms": common.percentile(figures.ready, 0.99) * 1e3,
        **call_rates(name, args),
        "store_cpu_s_per_gib": store.cpu_s / (total / common.GIB),
        "load_cpu_s_per_gib": load.cpu_s / (max(promoted, 1) / common.GIB),
        "store_cpu_s_by_thread": store.cpu_by_thread,
        "load_cpu_s_by_thread": load.cpu_by_thread,
        "loop_lag_p99_ms": lag,
        "busy_share_store": store.busy_share,
        "busy_share_load": load.busy_share,
        "mismatches": figures.mismatches,
        "copy_failures": figures.copy_failures,
        "lookup_misses": figures.lookup_misses,
        "requests_loaded": len(figures.waits),
        "promoted_bytes": promoted,
        "own_files_read_gbps": own_read,
        "files_on_disk": len(files),
        "store_s": store.seconds,
        "load_s": load.seconds,
        "steps": figures.steps,
        "fs": fs,
    }


def call_rates(name: str, args: argparse.Namespace) -> dict[str, float]:
    """Lookup hits and one-chunk store cycles per second through ``name``'s manager.

    ``benchmarks/scheduler.py``'s measure, through vLLM's interface: a primary tier
    alone of ``--stored`` 4 KiB chunks, full, every call under one hold of the lock.
    The calls run in :data:`RATE_ROUNDS` rounds and the fastest round counts, as
    ``timeit`` counts its best: a round can only be slowed by what else runs on the
    machine (the same process's rates moved by a third between sittings here).
    """
    spec = create_spec(name, 4096, 4096 * args.stored, [])
    manager = spec.get_manager()
    req = ReqContext("bench-rates")
    keys = chunk_keys(f"rates-{args.seed}", args.stored)
    fresh = [[key] for key in chunk_keys(f"cycles-{args.seed}", args.store_cycles)]
    probes = (keys * (args.lookups // len(keys) + 1))[: args.lookups]
    try:
        with manager.lock:
            manager.on_new_request(req)
            for first in range(0, len(keys), 1000):
                out = manager.prepare_store(keys[first : first + 1000], req)
                assert out is not None, "the primary tier refused its first chunks"
                manager.complete_store(out.keys_to_store, req)
            if manager.lookup(keys[-1], req) is not LookupResult.HIT:
                raise RuntimeError(f"{name}: a chunk just stored is not a hit")
            lookup, prepare, complete = (
                manager.lookup,
                manager.prepare_store,
                manager.complete_store,
            )
            lookup_rates, cycle_rates = [], []
            for round_ in range(RATE_ROUNDS):
                some = probes[round_::RATE_ROUNDS]
                started = time.perf_counter()
                for key in some:
                    lookup(key, req)
                lookup_rates.append(len(some) / (time.perf_counter() - started))
                some = fresh[round_::RATE_ROUNDS]
                started = time.perf_counter()
                for one in some:
                    prepare(one, req)
                    complete(one, req)
                cycle_rates.append(len(some) / (time.perf_counter() - started))
            manager.on_request_finished(req)
    finally:
        manager.shutdown()
    return {"lookup_hit_ops_s": max(lookup_rates), "store_cycle_ops_s": max(cycle_rates)}


# ------------------------------------------------------------------------- the whole


#: The figures set side by side: name, label in the table, format. Counts are summed
#: over the runs, the rest are medians.
FIGURES = (
    ("store_gbps", "store GB/s", "{:.2f}"),
    ("promotion_gbps", "promotion GB/s", "{:.2f}"),
    ("request_wait_p50_ms", "request wait p50 ms", "{:.1f}"),
    ("request_wait_p99_ms", "request wait p99 ms", "{:.1f}"),
    ("request_ready_p50_ms", "request ready p50 ms", "{:.1f}"),
    ("request_ready_p99_ms", "request ready p99 ms", "{:.1f}"),
    ("lookup_hit_ops_s", "lookup hits/s", "{:,.0f}"),
    ("store_cycle_ops_s", "one-chunk store cycles/s", "{:,.0f}"),
    ("store_cpu_s_per_gib", "CPU s per GiB stored", "{:.2f}"),
    ("load_cpu_s_per_gib", "CPU s per GiB promoted", "{:.2f}"),
    ("loop_lag_p99_ms", "loop lag p99 ms", "{:.2f}"),
    ("mismatches", "mismatched chunks", "{}"),
)
COUNTS = ("mismatches", "copy_failures", "lookup_misses")


def side_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's figures over its runs: medians, and counts summed."""
    out: dict[str, Any] = {}
    for name, value in runs[0].items():
        values = [run[name] for run in runs]
        if name in COUNTS:
            out[name] = sum(values)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = statistics.median(values)
    return out


def summarize(
    runs: dict[str, list[dict[str, Any]]], raw: dict[str, float], facts: dict[str, Any]
) -> dict[str, Any]:
    """The flat JSON report: each side's figures, kvtier over vLLM, and the raw limit."""
    sides = {name: side_figures(runs[name]) for name in SIDES if runs[name]}
    out: dict[str, Any] = {}
    for name, figures in sides.items():
        out |= {f"{name}_{key}": value for key, value in figures.items()}
    for key, *_ in FIGURES:
        base, ours = sides.get("vllm", {}).get(key), sides.get("kvtier", {}).get(key)
        if base and ours is not None:
            out[f"ratio_{key}"] = ours / base
    out |= raw
    for name in sides:
        out[f"{name}_store_ratio"] = sides[name]["store_gbps"] / raw["raw_write_gbps"]
        out[f"{name}_promotion_ratio"] = sides[name]["promotion_gbps"] / raw["raw_read_gbps"]
        # Run by run against the read of its own files, then the median.
        out[f"{name}_promotion_own_ratio"] = statistics.median(
            run["promotion_gbps"] / run["own_files_read_gbps"] for run in runs[name]
        )
        out[f"{name}_fs"] = runs[name][-1]["fs"]
    out |= facts
    if "vllm" in sides:
        # What kvtier's CPU per GiB stored is held to: vLLM's, plus the checksum pass.
        out["store_cpu_s_per_gib_allowed"] = (
            sides["vllm"]["store_cpu_s_per_gib"] + facts["checksum_cpu_s_per_gib"]
        )
    out["figures"] = [list(figure) for figure in FIGURES]
    for name in sides:
        out[f"{name}_runs"] = [{k: v for k, v in run.items() if k != "fs"} for run in runs[name]]
    return common.rounded(out)


def raw_depths(threads: int) -> list[int]:
    """The thread counts the raw reference is measured at: from one to twice vLLM's
    (``threads``), so that it is the disk's best at any depth, not at the tiers' own."""
    return sorted({1, 4, threads, 2 * threads})


def room_to_keep(args: argparse.Namespace, root: Path) -> bool:
    """Whether the files of every raw pass and every run fit under ``root`` at once.

    They are then all kept until the end (``keep`` of ``physical.measure_disk``), so
    that no run creates its files just after others were removed: on ext4 without a
    journal that costs up to 0.6 ms of CPU per file created, and it would fall on the
    run after the removal, not on a side.
    """
    passes = 2 * len(raw_depths(args.raw_threads)) + args.runs * len(args.sides)
    chunks = args.requests * args.job_chunks
    need = passes * chunks * (args.chunk_bytes + HEADER_BYTES)  # kvtier's header page
    return shutil.disk_usage(root).free > need * 1.05 + common.GIB


def o_direct_works(directory: Path) -> bool:
    """Whether ``directory`` takes O_DIRECT I/O, as vLLM's fs tier probes it."""
    from vllm.v1.kv_offload.tiering.fs.io import probe_o_direct

    directory.mkdir(parents=True, exist_ok=True)
    return bool(probe_o_direct(str(directory)))


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    # Before any vLLM fs module is imported: they decide their I/O path on import.
    extension = load_fs_io_extension()
    torch.set_num_threads(1)  # the worker thread's copies: one thread, as on a GPU stream
    page_cache = page_cache_mode(args)
    chunk, job = args.chunk_bytes, args.job_chunks
    count = args.requests * job
    keys = chunk_keys(str(args.seed), count)
    requests = [keys[i : i + job] for i in range(0, count, job)]
    direct = o_direct_works(root)
    keep = room_to_keep(args, root)

    def raw(name: str) -> common.DiskLimits:
        return common.measure_disk(
            root / name,
            count,
            chunk,
            depths=raw_depths(args.raw_threads),
            direct=direct,
            keep=keep,
        )

    before = raw("raw-before")
    gpu = torch.zeros(((args.in_flight + 2) * job, chunk // 8), dtype=torch.int64)
    patterns = common.Patterns([gpu], args.seed)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SIDES}
    for i in range(args.runs):
        for name in args.sides:  # alternating, so drift falls on both
            runs[name].append(
                run_once(
                    name, args, root / f"{name}-{i}", requests, patterns, page_cache, direct, keep
                )
            )
    limits = common.raw_disk(before, raw("raw-after"))
    facts = {
        # kvtier's fs tier hashes every chunk it writes; vLLM's writes the bytes as they
        # are. What that pass alone costs, on bytes not in the CPU's caches.
        "checksum_cpu_s_per_gib": physical.measure_checksum(chunk),
        "page_cache": page_cache,
        "busy_host": args.busy_host,
        "busy_threads": args.busy_threads,
        "raw_o_direct": direct,
        "files_kept": keep,
        "raw_threads": args.raw_threads,
        "raw_depths": raw_depths(args.raw_threads),
        "vllm_io_path": vllm_io_path(),
        "fs_io_extension": extension,
        "runs": args.runs,
        "chunks": count,
        "chunk_bytes": chunk,
        "job_chunks": job,
        "in_flight": args.in_flight,
        "primary_bytes": int(args.primary_gib * common.GIB),
    }
    return summarize(runs, limits, facts)


def report(figures: dict[str, Any]) -> str:
    """Print the table and the JSON line; return the JSON."""
    total = figures["chunks"] * figures["chunk_bytes"] / common.GIB
    cold = {"drop_caches": "dropped", "fadvise": "evicted with posix_fadvise(DONTNEED)"}
    vllm_fs = figures.get("vllm_fs", {"o_direct": "-", "read_threads": "-", "write_threads": "-"})
    kvtier_fs = figures.get("kvtier_fs", {"o_direct": "-", "read_depth": "-", "write_depth": "-"})
    print(
        f"vs vLLM: {total:.2f} GiB of {figures['chunk_bytes'] / common.MIB:g} MiB chunks in "
        f"{figures['job_chunks']}-chunk requests, {figures['in_flight']} in flight, primary "
        f"{figures['primary_bytes'] / common.GIB:.2f} GiB; medians of {figures['runs']} "
        f"alternating runs each"
    )
    print(
        f"  page cache {cold[figures['page_cache']]} before each phase; vLLM's fs I/O: "
        f"{figures['vllm_io_path']} (fs_io_C {figures['fs_io_extension']}), O_DIRECT "
        f"{vllm_fs['o_direct']}, {vllm_fs['read_threads']} read / {vllm_fs['write_threads']} "
        f"write threads; kvtier's fs: O_DIRECT "
        f"{kvtier_fs['o_direct']}, depth {kvtier_fs['read_depth']} read / "
        f"{kvtier_fs['write_depth']} write"
    )
    if figures["busy_host"]:
        shares = [
            figures[f"{name}_busy_share_{phase}"]
            for name in SIDES
            for phase in ("store", "load")
            if f"{name}_busy_share_{phase}" in figures
        ]
        print(
            f"  busy host: {figures['busy_threads']} thread(s) running Python for "
            f"{figures['busy_host']:g} of a core during stores and promotions (measured "
            f"{min(shares):.2f}-{max(shares):.2f}); their CPU is not counted in the figures"
        )
    else:
        print("  quiet host: nothing else runs in the process")
    if not figures["files_kept"]:
        print(
            "  too little free space to keep every run's files until the end: each run's "
            "were removed after it, which may slow the next one's file creations"
        )
    sides = [name for name in SIDES if f"{name}_fs" in figures]
    print(f"  {'figure':<26}{'vLLM':>14}{'kvtier':>14}{'kvtier/vLLM':>14}")
    for key, label, style in FIGURES:
        cells = [figures.get(f"{name}_{key}") for name in SIDES]
        shown = ["-" if value is None else style.format(value) for value in cells]
        ratio = figures.get(f"ratio_{key}")
        shown.append("-" if ratio is None else f"{ratio:.2f}")
        print(f"  {label:<26}" + "".join(f"{cell:>14}" for cell in shown))
    print(
        f"  raw disk (best of {', '.join(map(str, figures['raw_depths']))} threads, "
        f"{figures['chunk_bytes'] / common.MIB:g} MiB I/Os, O_DIRECT {figures['raw_o_direct']}): "
        + ", ".join(
            f"{way} {figures[f'raw_{way}_gbps']:.2f} GB/s (before "
            f"{figures[f'raw_{way}_gbps_before']:.2f}, "
            f"after {figures[f'raw_{way}_gbps_after']:.2f})"
            for way in ("write", "read")
        )
    )
    print(
        "  against raw: store "
        + ", ".join(f"{LABELS[n]} {figures[f'{n}_store_ratio']:.2f}" for n in sides)
        + "; promotion "
        + ", ".join(f"{LABELS[n]} {figures[f'{n}_promotion_ratio']:.2f}" for n in sides)
    )
    print(
        "  promotion against a raw read of the run's own files, just after it: "
        + ", ".join(
            f"{LABELS[n]} {figures[f'{n}_promotion_own_ratio']:.2f} (read at "
            f"{figures[f'{n}_own_files_read_gbps']:.2f} GB/s)"
            for n in sides
        )
    )
    if "store_cpu_s_per_gib_allowed" in figures and "kvtier_store_cpu_s_per_gib" in figures:
        print(
            f"  CPU per GiB stored: kvtier {figures['kvtier_store_cpu_s_per_gib']:.3f} s against "
            f"vLLM's {figures['vllm_store_cpu_s_per_gib']:.3f} s + the checksum pass alone "
            f"{figures['checksum_cpu_s_per_gib']:.3f} s = "
            f"{figures['store_cpu_s_per_gib_allowed']:.3f} s"
        )
    text = json.dumps(figures)
    print(text)
    return text


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    text = report(common.run_in_scratch(run, args, "vs_vllm.py"))
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
