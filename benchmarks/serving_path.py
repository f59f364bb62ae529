"""The serving path: a synchronous scheduler and a worker thread drive kvtier with the fs tier.

This walks the path a serving host walks, through the scheduler-facing API only:
``OffloadingSpecFactory.create_spec`` (``TieringOffloadingSpec`` with one fs tier),
``spec.get_manager()`` (a synchronous host: the manager runs its tiers on a loop thread
of its own) and ``spec.create_worker(kv_caches)``. The scheduler runs on the main
thread; a worker thread does the copies (``submit_store`` / ``submit_load`` /
``get_finished``), as a GPU worker process would.

1. Raw reference: the raw disk limit ``kvtier bench`` uses
   (``kvtier.bench.physical.measure_disk``): as many one-chunk files as the tier
   stores, on the same filesystem, written with ``os.pwritev`` and read back cold with
   ``os.preadv`` (both O_DIRECT where the tier uses it), by one thread and by the
   tier's depth; the limit is the better of the two.
2. Stores: ``--gib`` of distinct chunks, each holding a pattern derived from its key,
   stored as requests of ``--job-chunks`` chunks, one request per step
   (``prepare_store``, the worker's copy, ``complete_store``); the clock runs until
   every cascade to the fs tier finished and ``os.sync()`` returned.
3. Promotions: the primary tier emptied (``reset_cache``) and the page cache dropped,
   the stored requests come back in a seeded random order, ``--in-flight`` at once.
   Each step looks up every key of every waiting request; a request whose keys are all
   HIT is pinned (``prepare_load``), copied into the KV tensors by the worker, compared
   chunk by chunk with what was stored, unpinned and finished. A promotion job's time
   runs from its start on the tier until its chunks are readable (the manager's
   measured samples); a request's wait runs from its first lookup that answered
   HIT_PENDING or RETRY to the one that found all its chunks readable, and includes
   its turn behind the other requests' jobs.
4. The raw reference again; the limit is the mean of the two.

Every step ends with ``on_schedule_end``. An event-loop probe runs on the manager's
loop thread throughout. Then the scheduler call rates of ``benchmarks/scheduler.py``.

The last line is one JSON object: ``promotion_gbps``, ``promotion_ratio``,
``store_gbps``, ``store_ratio``, ``promotion_p50_ms``, ``promotion_p99_ms`` (job times),
``promotion_p99_budget_ms`` (3 x a job's bytes / raw read bandwidth; the p50 budget is
1.5 x), ``request_wait_p50_ms`` / ``request_wait_p99_ms``,
``loop_lag_p99_ms``, ``lookup_hit_ops_s``, ``store_cycle_ops_s``, ``mismatches``, and
more.

    python benchmarks/serving_path.py --root /path/on/the/disk/to/measure
    python benchmarks/serving_path.py --quick     # a few seconds, small sizes
"""

from __future__ import annotations

import argparse
import hashlib
import os
import queue
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from common import (
    GIB,
    MIB,
    FsTierShape,
    PathRun,
    Patterns,
    check_workload_args,
    cold_read_mode,
    make_reads_cold,
    print_json,
    print_path_summary,
    run_in_scratch,
    tier_options,
    workload_parser,
)
from scheduler import measure_scheduler

from kvtier import (
    LookupResult,
    OffloadingConfig,
    OffloadingSpecFactory,
    OffloadKey,
    ReqContext,
    TieringOffloadingManager,
    make_offload_key,
)
from kvtier.hosts import Step, step_until_blocking
from kvtier.records import TransferResult
from kvtier.worker import OffloadingWorker

# How often the worker thread polls for finished copies while some are in flight.
_COPY_POLL_S = 0.0002


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = workload_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--lookups", type=int, default=2_000_000)
    parser.add_argument("--store-cycles", type=int, default=300_000)
    args = parser.parse_args(argv)
    check_workload_args(parser, args)
    if args.quick:
        args.lookups, args.store_cycles, args.stored = 20_000, 5_000, 5_000
    else:
        args.stored = 100_000
    return args


# ------------------------------------------------------------------ the worker side


@dataclass
class Copy:
    """A copy job the scheduler hands to the worker thread."""

    job_id: int
    store: bool
    req: ReqContext
    keys: list[OffloadKey]
    blocks: list[int]
    chunk_ids: list[int]
    group: int


@dataclass
class Copied:
    copy: Copy
    result: TransferResult
    #: Loaded chunks whose bytes differ from what was stored under their key.
    wrong: int


class CopyThread(threading.Thread):
    """The worker process's role: runs copies, checks loaded bytes, reports back."""

    def __init__(self, worker: OffloadingWorker, patterns: Patterns) -> None:
        super().__init__(name="bench-worker", daemon=True)
        self.worker = worker
        self.patterns = patterns
        self.inbox: queue.SimpleQueue[Copy | None] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[Copied] = queue.SimpleQueue()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            self.error = exc

    def _serve(self) -> None:
        worker, pending = self.worker, {}
        while True:
            try:
                copy = self.inbox.get(timeout=_COPY_POLL_S if pending else None)
            except queue.Empty:
                copy = False
            if copy is None:
                return
            if copy:
                pending[copy.job_id] = copy
                if copy.store:
                    self.patterns.write(copy.keys, copy.blocks)
                    worker.submit_store(copy.job_id, copy.blocks, copy.chunk_ids)
                else:
                    worker.submit_load(copy.job_id, copy.chunk_ids, copy.blocks)
            for result in worker.get_finished():
                done = pending.pop(result.job_id)
                wrong = 0
                if not done.store and result.success:
                    wrong = self.patterns.wrong(done.keys, done.blocks)
                self.outbox.put(Copied(done, result, wrong))


# --------------------------------------------------------------- the scheduler side


@dataclass
class Waiting:
    """A load request the scheduler looks up step after step."""

    req: ReqContext
    keys: list[OffloadKey]
    group: int
    admitted: float
    #: When a lookup first answered HIT_PENDING or RETRY; None while none has.
    asked: float | None = None


@dataclass
class Figures:
    promotion_s: list[float] = field(default_factory=list)
    mismatches: int = 0
    lookup_misses: int = 0
    copy_failures: int = 0
    steps: int = 0
    resident_requests: int = 0


class Scheduler:
    """The scheduler's loop: one step after another, each ended by ``on_schedule_end``."""

    def __init__(
        self,
        manager: TieringOffloadingManager,
        copier: CopyThread,
        job_chunks: int,
        in_flight: int,
        timeout_s: float,
        idle_s: float,
    ) -> None:
        self.manager = manager
        self.idle_s = idle_s
        self.copier = copier
        self.job_chunks = job_chunks
        self.in_flight = in_flight
        self.timeout_s = timeout_s
        self.figures = Figures()
        self._job_ids = 0

    def blocks_of(self, group: int) -> list[int]:
        return list(range(group * self.job_chunks, (group + 1) * self.job_chunks))

    def store_all(self, requests: Sequence[list[OffloadKey]]) -> float:
        """Seconds to store ``requests``, one per step, and cascade them to disk."""
        manager = self.manager
        started = time.perf_counter()
        pending = deque(enumerate(requests))
        # Two groups of blocks: the next request's copy may start while one finishes.
        free = deque(range(self.in_flight, self.in_flight + 2))

        def step() -> Step:
            if not (pending or len(free) < 2):
                return Step.DONE
            progressed = self._take_copies(free)
            if pending and free:
                index, keys = pending[0]
                req = ReqContext(f"store-{index}")
                out = manager.prepare_store(keys, req)
                if out is not None:
                    pending.popleft()
                    progressed = True
                    if out.keys_to_store:
                        group = free.popleft()
                        blocks = self.blocks_of(group)[: len(out.keys_to_store)]
                        chunk_ids = list(out.store_spec.chunk_ids)
                        self._send(True, req, list(out.keys_to_store), blocks, chunk_ids, group)
                    else:
                        manager.on_request_finished(req)
            return self._end_step(progressed)

        def cascaded() -> Step:
            return self._end_step(False) if manager.has_pending_work() else Step.DONE

        self._run(step)
        self._run(cascaded)
        os.sync()
        return time.perf_counter() - started

    def load_all(self, requests: Sequence[list[OffloadKey]]) -> float:
        """Seconds to bring ``requests`` back into the KV tensors, ``in_flight`` at once."""
        manager, figures = self.manager, self.figures
        started = time.perf_counter()
        pending = deque(enumerate(requests))
        free = deque(range(self.in_flight))
        waiting: list[Waiting] = []
        lookup = manager.lookup

        def step() -> Step:
            if not (pending or waiting or len(free) < self.in_flight):
                return Step.DONE
            progressed = self._take_copies(free)
            while pending and free:
                index, keys = pending.popleft()
                group = free.popleft()
                req = ReqContext(f"load-{index}")
                manager.on_new_request(req)
                waiting.append(Waiting(req, keys, group, time.perf_counter()))
            still: list[Waiting] = []
            for entry in waiting:
                results = [lookup(key, entry.req) for key in entry.keys]
                now = time.perf_counter()
                hits = results.count(LookupResult.HIT)
                if hits == len(results):
                    if entry.asked is None:
                        figures.resident_requests += 1
                    else:
                        figures.promotion_s.append(now - entry.asked)
                    slots = list(manager.prepare_load(entry.keys, entry.req).chunk_ids)
                    blocks = self.blocks_of(entry.group)[: len(entry.keys)]
                    self._send(False, entry.req, entry.keys, blocks, slots, entry.group)
                    progressed = True
                    continue
                if entry.asked is None:
                    entry.asked = now
                figures.lookup_misses += results.count(LookupResult.MISS)
                if now - entry.admitted > self.timeout_s:
                    raise RuntimeError(
                        f"request {entry.req.req_id} still has {len(results) - hits} of "
                        f"{len(results)} chunks unreadable after {self.timeout_s:g} s"
                    )
                still.append(entry)
            waiting[:] = still
            return self._end_step(progressed)

        self._run(step)
        return time.perf_counter() - started

    def _send(
        self,
        store: bool,
        req: ReqContext,
        keys: list[OffloadKey],
        blocks: list[int],
        chunk_ids: list[int],
        group: int,
    ) -> None:
        self._job_ids += 1
        self.copier.inbox.put(Copy(self._job_ids, store, req, keys, blocks, chunk_ids, group))

    def _take_copies(self, free: deque[int]) -> bool:
        """Finish the requests whose copies the worker reported; whether there were any."""
        manager, figures = self.manager, self.figures
        if self.copier.error is not None:
            raise RuntimeError("the worker thread failed") from self.copier.error
        took = False
        while True:
            try:
                copied = self.copier.outbox.get_nowait()
            except queue.Empty:
                return took
            took = True
            copy, success = copied.copy, copied.result.success
            figures.copy_failures += not success
            if copy.store:
                manager.complete_store(copy.keys, copy.req, success)
            else:
                figures.mismatches += copied.wrong + (0 if success else len(copy.keys))
                manager.complete_load(copy.keys, copy.req)
                self.loaded(copy)
            manager.on_request_finished(copy.req)
            free.append(copy.group)

    def loaded(self, copy: Copy) -> None:
        """A request's chunks are in the KV tensors (a subclass may time it)."""

    def _end_step(self, progressed: bool) -> Step:
        """End the step; one that moved nothing waits for a completion, at most the
        idle time (the worker's copies do not wake it)."""
        self.manager.on_schedule_end()
        self.figures.steps += 1
        return Step.AGAIN if progressed else Step.WAIT

    def _run(self, step: Callable[[], Step]) -> None:
        step_until_blocking(self.manager.host, step, recheck=lambda: self.idle_s)


# ----------------------------------------------------------------------- the run


def chunk_keys(seed: int, count: int) -> list[OffloadKey]:
    return [
        make_offload_key(hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=16).digest())
        for i in range(count)
    ]


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    chunk = int(args.chunk_mib * MIB)
    count = max(1, int(args.gib * GIB) // chunk // args.job_chunks) * args.job_chunks
    tier = {"type": "fs", "root_dir": str(root / "tier"), **tier_options(args.tier_option)}
    config = OffloadingConfig(
        engine_id=f"bench-serving-{uuid.uuid4().hex[:8]}",
        kv_bytes_per_block=chunk,
        model_name="bench",
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": int(args.primary_gib * GIB),
            "secondary_tiers": [tier],
        },
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    blocks = (args.in_flight + 2) * args.job_chunks
    caches = [
        torch.zeros((blocks, chunk // 2 // 8), dtype=torch.int64, device=device) for _ in range(2)
    ]
    cache_mode = cold_read_mode(args)
    spec = OffloadingSpecFactory.create_spec(config)
    try:
        manager = spec.get_manager()
        worker = spec.create_worker(caches)
        fs = FsTierShape(manager)
        chunk = spec.chunk_bytes  # rounded up to whole pages
        measured = PathRun(args, fs, cache_mode, device)
        measured.begin(manager, root, count, chunk)
        copier = CopyThread(worker, Patterns(caches, args.seed))
        copier.start()
        keys = chunk_keys(args.seed, count)
        requests = [keys[i : i + args.job_chunks] for i in range(0, count, args.job_chunks)]
        scheduler = Scheduler(
            manager, copier, args.job_chunks, args.in_flight, args.timeout_s, args.idle_ms / 1e3
        )
        try:
            measured.phase("store", scheduler.store_all, requests)
            manager.reset_cache()
            make_reads_cold(cache_mode, root / "tier")
            order = list(requests)
            random.Random(args.seed).shuffle(order)
            measured.phase("load", scheduler.load_all, order)
        finally:
            copier.inbox.put(None)
            copier.join()
            measured.end(manager)
    finally:
        spec.shutdown()
    figures = scheduler.figures
    return {
        **measured.figures(root, count, chunk, figures.promotion_s),
        "mismatches": figures.mismatches,
        "resident_requests": figures.resident_requests,
        "lookup_misses": figures.lookup_misses,
        "copy_failures": figures.copy_failures,
        "steps": figures.steps,
        "steps_per_s": figures.steps / sum(measured.seconds.values()),
    }


def report(figures: dict[str, Any]) -> None:
    total = figures["chunks"] * figures["chunk_bytes"] / GIB
    print(
        f"serving path: {total:.2f} GiB of {figures['chunk_bytes'] / MIB:g} MiB chunks in "
        f"{figures['job_chunks']}-chunk requests, {figures['in_flight']} loads in flight, "
        f"fs tier depth {figures['read_depth']} read / {figures['write_depth']} write, "
        f"page cache {figures['page_cache']}, KV tensors on {figures['device']}"
    )
    print_path_summary(figures)
    print(
        f"  scheduler: {figures['lookup_hit_ops_s'] / 1e6:.2f} M lookups/s, "
        f"{figures['store_cycle_ops_s'] / 1e3:.0f} k store cycles/s (a bare locked "
        f"lookup: {figures['lookup_floor_ops_s'] / 1e6:.2f} M/s); "
        f"{figures['mismatches']} mismatched chunks"
    )
    print_json(figures)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    figures = run_in_scratch(run, args, "serving_path.py")
    rates = measure_scheduler(args.lookups, args.store_cycles, stored=args.stored)
    figures["lookup_hit_ops_s"] = rates["lookups_per_s"]
    figures["store_cycle_ops_s"] = rates["store_cycles_per_s"]
    figures["lookup_floor_ops_s"] = rates["floor_lookups_per_s"]
    report(figures)


if __name__ == "__main__":
    main()
