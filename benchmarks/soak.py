"""A randomized soak of the await-based API: many requests, resets and cancellations.

Tasks play serving requests against one ``KVTier`` with an fs tier and a flaky plugin
tier (this module's :class:`FlakyTier`: loads and stores in worker threads, some slow
past the job timeout, some failing, some partial). Each request looks its prompt up,
loads the hits and checks every loaded byte, writes the rest and stores it, then
finishes; some are cancelled at a random point, and now and then a task resets the
cache. At the end nothing may be pinned and no byte may have been wrong.

    python benchmarks/soak.py --duration 120 --tasks 16

The test suite runs the same soak for a few seconds (tests/test_soak.py). The last
stdout line is JSON with the counts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

from kvtier import JobResult, KVTier, OffloadingConfig, SecondaryTier, TierContext, TransferJob
from kvtier.keys import OffloadKey, make_offload_key
from kvtier.worker import ThreadedCopyEngine

BLOCK_BYTES = 4096
BLOCKS_PER_CHUNK = 2


class FlakyTier(SecondaryTier):
    """An in-memory plugin tier that misbehaves the ways real storage does.

    Parameters: ``seed`` (int), ``slow_share`` (a share of jobs sleeping past the job
    timeout), ``fail_share`` (a share of jobs raising), ``lose_share`` (a share of keys
    a load does not find). Its I/O runs in ``anyio.to_thread.run_sync``, as the tier
    interface asks.
    """

    def __init__(
        self,
        ctx: TierContext,
        seed: int = 0,
        slow_share: float = 0.05,
        fail_share: float = 0.05,
        lose_share: float = 0.05,
    ) -> None:
        super().__init__(ctx)
        self._random = random.Random(seed)
        self._slow, self._fail, self._lose = slow_share, fail_share, lose_share
        self._chunks: dict[OffloadKey, bytes] = {}
        self._lock = threading.Lock()

    def contains(self, key: OffloadKey) -> bool | None:
        return key in self._chunks

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        return [key in self._chunks for key in keys]

    async def store(self, job: TransferJob) -> JobResult:
        await anyio.to_thread.run_sync(self._store, job)
        return JobResult(job.job_id, True)

    async def load(self, job: TransferJob) -> JobResult:
        loaded = await anyio.to_thread.run_sync(self._load, job)
        return JobResult(job.job_id, len(loaded) == len(job.keys), successful_keys=loaded)

    def _misbehave(self) -> None:
        with self._lock:
            roll = self._random.random()
        if roll < self._slow:
            time.sleep(self.ctx.job_timeout_s * 1.5)
        elif roll < self._slow + self._fail:
            raise OSError(5, "flaky tier failed on purpose")

    def _store(self, job: TransferJob) -> None:
        self._misbehave()
        view = self.ctx.primary_view
        for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
            self._chunks[key] = bytes(view[chunk_id])

    def _load(self, job: TransferJob) -> list[OffloadKey]:
        self._misbehave()
        view = self.ctx.primary_view
        loaded = []
        for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
            with self._lock:
                lost = self._random.random() < self._lose
            chunk = self._chunks.get(key)
            if chunk is not None and not lost:
                view[chunk_id][:] = chunk
                loaded.append(key)
        return loaded


@dataclass
class SoakReport:
    requests: int = 0
    cancelled: int = 0
    resets: int = 0
    chunks_loaded: int = 0
    chunks_stored: int = 0
    mismatches: int = 0
    pinned_at_end: int = 0
    duration_s: float = 0.0


def chunk_pattern(key: OffloadKey) -> torch.Tensor:
    """The bytes every chunk of ``key`` holds, as the blocks of one chunk."""
    seed = hashlib.sha256(key).digest()
    data = (seed * (BLOCK_BYTES * BLOCKS_PER_CHUNK // len(seed) + 1))[
        : BLOCK_BYTES * BLOCKS_PER_CHUNK
    ]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(BLOCKS_PER_CHUNK, BLOCK_BYTES)


def soak_config(root: Path, *, primary_chunks: int, seed: int) -> OffloadingConfig:
    tiers: list[dict[str, Any]] = [
        {"type": "fs", "root_dir": str(root)},
        {
            "type": "FlakyTier",
            "module_path": "soak",
            "seed": seed,
            "job_timeout_s": 0.2,
            "lookup_timeout_s": 0.2,
            "shutdown_grace_s": 1.0,
        },
    ]
    return OffloadingConfig(
        engine_id=f"soak-{uuid.uuid4().hex[:10]}",
        kv_bytes_per_block=BLOCK_BYTES,
        tokens_per_block=16,
        model_name="soak",
        kv_dtype="uint8",
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": primary_chunks * BLOCK_BYTES * BLOCKS_PER_CHUNK,
            "block_size": 16 * BLOCKS_PER_CHUNK,
            "secondary_tiers": tiers,
        },
    )


class Soak:
    def __init__(self, kv: KVTier, cache: torch.Tensor, *, tasks: int, seed: int) -> None:
        self.kv = kv
        self.cache = cache
        self.tasks = tasks
        self.random = random.Random(seed)
        self.report = SoakReport()
        # Prompts share prefixes: a few system prompts, each followed by user turns.
        self.prompts = [
            [_key(f"system-{s}", i) for i in range(6)]
            + [_key(f"user-{s}-{u}", i) for i in range(6)]
            for s in range(4)
            for u in range(6)
        ]

    async def run(self, duration_s: float) -> SoakReport:
        started = time.monotonic()
        deadline = started + duration_s
        await asyncio.gather(*(self._task(i, deadline) for i in range(self.tasks)))
        await self.kv.drain()
        self.report.pinned_at_end = self.kv.manager.primary.num_busy
        self.report.duration_s = round(time.monotonic() - started, 2)
        return self.report

    async def _task(self, index: int, deadline: float) -> None:
        blocks_per_task = len(self.prompts[0]) * BLOCKS_PER_CHUNK
        first_block = index * blocks_per_task
        count = 0
        while time.monotonic() < deadline:
            count += 1
            if self.random.random() < 0.02:
                await self.kv.reset()
                self.report.resets += 1
                continue
            req_id = f"t{index}-{count}"
            request = asyncio.ensure_future(self._request(req_id, first_block))
            if self.random.random() < 0.2:
                await asyncio.sleep(self.random.random() * 0.02)
                request.cancel()
            try:
                await request
            except asyncio.CancelledError:
                self.report.cancelled += 1
                # Its copies run on to their end: the blocks are reusable once they did.
                await self.kv.drain()
            finally:
                self.kv.finish(req_id)
            self.report.requests += 1

    async def _request(self, req_id: str, first_block: int) -> None:
        kv, cache = self.kv, self.cache
        prompt = self.random.choice(self.prompts)
        blocks = list(range(first_block, first_block + len(prompt) * BLOCKS_PER_CHUNK))
        hits = await kv.lookup(prompt, req_id, timeout=self.random.choice((0.0, 0.05, 1.0)))
        loaded = await kv.load(prompt[:hits], blocks[: hits * BLOCKS_PER_CHUNK], req_id)
        for i, key in enumerate(prompt[:loaded]):
            chunk = cache[blocks[i * BLOCKS_PER_CHUNK] : blocks[(i + 1) * BLOCKS_PER_CHUNK - 1] + 1]
            if not torch.equal(chunk, chunk_pattern(key)):
                self.report.mismatches += 1
        self.report.chunks_loaded += loaded
        for i, key in enumerate(prompt[loaded:], start=loaded):
            start = blocks[i * BLOCKS_PER_CHUNK]
            cache[start : start + BLOCKS_PER_CHUNK] = chunk_pattern(key)
        self.report.chunks_stored += await kv.store(prompt, blocks, req_id, timeout=1.0)


def _key(name: str, index: int) -> OffloadKey:
    return make_offload_key(hashlib.sha256(f"{name}/{index}".encode()).digest()[:16])


async def run_soak(
    root: Path, *, duration_s: float, tasks: int = 8, primary_chunks: int = 48, seed: int = 0
) -> SoakReport:
    """Soak one KVTier for ``duration_s``; a report with no mismatch and no pin is a pass."""
    blocks = tasks * 12 * BLOCKS_PER_CHUNK
    cache = torch.zeros((blocks, BLOCK_BYTES), dtype=torch.uint8)
    config = soak_config(root, primary_chunks=primary_chunks, seed=seed)
    engine = ThreadedCopyEngine(delay_s=0.0005)
    async with KVTier(config, [cache], engine=engine) as kv:
        return await Soak(kv, cache, tasks=tasks, seed=seed).run(duration_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds (default 60)")
    parser.add_argument("--tasks", type=int, default=16, help="concurrent requests")
    parser.add_argument("--primary-chunks", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=None, help="fs tier directory")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        root = args.root or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        report = asyncio.run(
            run_soak(
                root,
                duration_s=args.duration,
                tasks=args.tasks,
                primary_chunks=args.primary_chunks,
                seed=args.seed,
            )
        )
    print(json.dumps(asdict(report)))
    if report.mismatches or report.pinned_at_end:
        raise SystemExit("the soak found wrong bytes or leaked pins")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
