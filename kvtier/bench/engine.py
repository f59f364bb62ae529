"""A serving engine's KV bookkeeping in miniature, on real tensors.

The simulated engine owns a pool of GPU blocks (real CUDA tensors when a GPU is present,
CPU tensors standing in otherwise). For each request it looks the prompt's chunks up,
loads the hits into its blocks (checking every loaded byte against what was stored),
"computes" the rest by writing a pattern derived from each chunk's key, and stores
them: exactly the KVTier calls an async serving stack makes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from kvtier.bench.settings import BenchSettings
from kvtier.bench.workloads import BenchRequest, chain_keys
from kvtier.facade import KVTier
from kvtier.keys import OffloadKey
from kvtier.resources import BlockingResource
from kvtier.worker.engines import ThreadedCopyEngine

__all__ = ["Engine", "ServedRequest", "copy_engine", "device", "kv_caches"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class ServedRequest:
    """What serving one request took and found."""

    chunks: int
    #: Chunks loaded instead of computed.
    hits: int
    stored: int
    #: Loaded chunks whose bytes differ from what their key's computation wrote.
    wrong_chunks: int
    lookup_s: float
    load_s: float
    store_s: float


class Engine(BlockingResource):
    """A GPU block pool and the requests it serves through ``kv``."""

    def __init__(self, kv: KVTier, caches: list[torch.Tensor], blocks: int, timeout: float) -> None:
        self.kv = kv
        self.caches = caches
        self.free = list(range(blocks))
        self.freed = asyncio.Condition()
        self.timeout = timeout
        # Checking and "computing" are the GPU's work, done in order on its stream: one
        # thread stands in for it, off the event loop, rather than a pool of them
        # competing with the loop (and kvtier's tier threads) for the host's cores.
        self._device = ThreadPoolExecutor(1, thread_name_prefix="kvtier-bench-device")

    def close(self) -> None:
        self._device.shutdown(wait=True)

    async def _on_device(self, fn: Callable[..., _T], *args: object) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._device, fn, *args)

    async def serve(self, request: BenchRequest) -> ServedRequest:
        kv = self.kv
        keys = chain_keys(request.blocks)
        bpc = kv.blocks_per_chunk
        blocks = await self._allocate(len(keys) * bpc)
        try:
            started = time.perf_counter()
            hits = await kv.lookup(keys, request.req_id, timeout=self.timeout)
            looked_up = time.perf_counter()
            loaded = await kv.load(keys[:hits], blocks[: hits * bpc], request.req_id)
            copied = time.perf_counter()
            wrong = await self._on_device(self._check, keys[:loaded], blocks, bpc)
            await self._on_device(self._compute, keys[loaded:], blocks[loaded * bpc :], bpc)
            stored = await kv.store(keys, blocks, request.req_id)
            done = time.perf_counter()
            kv.finish(request.req_id)
        finally:
            await self._release(blocks)
        return ServedRequest(
            chunks=len(keys),
            hits=loaded,
            stored=stored,
            wrong_chunks=wrong,
            lookup_s=looked_up - started,
            load_s=copied - looked_up,
            store_s=done - copied,
        )

    async def compute_and_store(self, keys: list[OffloadKey], req_id: str) -> int:
        """Compute ``keys`` (as a prefill would) and store them; how many were stored."""
        bpc = self.kv.blocks_per_chunk
        blocks = await self._allocate(len(keys) * bpc)
        try:
            await self._on_device(self._compute, keys, blocks, bpc)
            stored = await self.kv.store(keys, blocks, req_id)
            self.kv.finish(req_id)
        finally:
            await self._release(blocks)
        return stored

    def _compute(self, keys: list[OffloadKey], blocks: list[int], bpc: int) -> None:
        """Prefill stand-in: every block of a chunk holds a value derived from its key."""
        for i, key in enumerate(keys):
            value = _seed(key)
            for block in blocks[i * bpc : (i + 1) * bpc]:
                for cache in self.caches:
                    cache[block].fill_(value)

    def _check(self, keys: list[OffloadKey], blocks: list[int], bpc: int) -> int:
        """How many loaded chunks differ from what their key's computation wrote."""
        wrong = 0
        for i, key in enumerate(keys):
            expected = _seed(key)
            # Block by block, as views: indexing with a list would copy each chunk.
            if any(
                not _holds_only(cache[block], expected)
                for block in blocks[i * bpc : (i + 1) * bpc]
                for cache in self.caches
            ):
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


def _holds_only(block: torch.Tensor, value: int) -> bool:
    """Whether every element of ``block`` is ``value``: one pass, no temporary tensor,
    one read back (a single sync on a GPU)."""
    return torch.stack(torch.aminmax(block)).tolist() == [value, value]


def _seed(key: OffloadKey) -> int:
    return int.from_bytes(key[:8], "big", signed=True)


def device() -> str:
    """Where the KV tensors live: ``cuda`` when a GPU is present, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def copy_engine() -> ThreadedCopyEngine | None:
    """The copy engine: the default next to a GPU, else background copy threads.

    Without a GPU, copies run on threads as they would on a GPU's copy streams, so the
    event loop is as free as it would be next to a real device.
    """
    return None if torch.cuda.is_available() else ThreadedCopyEngine()


def kv_caches(settings: BenchSettings, blocks: int) -> list[torch.Tensor]:
    """K and V tensors of this rank: CUDA when present, else CPU standing in."""
    per_half = settings.chunk_bytes // 2 // 8
    return [torch.zeros((blocks, per_half), dtype=torch.int64, device=device()) for _ in range(2)]
