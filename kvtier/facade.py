"""``KVTier``: the await-based face of kvtier for an async serving stack."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import torch
from prometheus_client import CollectorRegistry

from kvtier.config import OffloadingConfig
from kvtier.errors import KVTierError
from kvtier.keys import OffloadKey
from kvtier.records import LookupResult, ReqContext
from kvtier.region import DEFAULT_SHM_DIR
from kvtier.resources import AsyncResource, TaskSet
from kvtier.specs.base import OffloadingSpec
from kvtier.specs.factory import OffloadingSpecFactory
from kvtier.tiering.loop import HostLoop
from kvtier.tiering.manager import TieringOffloadingManager
from kvtier.worker.engines import CopyEngine
from kvtier.worker.worker import BlockIds, OffloadingWorker

__all__ = ["KVTier"]

_T = TypeVar("_T")


class KVTier(AsyncResource):
    """The manager and one worker, driven through ``await``.

    ``gpu_block_ids`` arguments hold ``blocks_per_chunk`` GPU block ids per key, in
    order. The facade drives the scheduler step protocol itself (lookup, end of step,
    waiting for completions) and never busy-waits. It must be used from one event loop,
    the one it was opened on; the tiers run on that loop too.

    A store or load keeps running to its end even if the task awaiting it is
    cancelled (a half-copied slot would otherwise be freed or served):
    :meth:`drain` and :meth:`aclose` wait for them.
    """

    def __init__(
        self,
        config: OffloadingConfig,
        kv_caches: Sequence[torch.Tensor],
        registry: CollectorRegistry | None = None,
        *,
        engine: CopyEngine | None = None,
        shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
    ) -> None:
        self.config = config
        self._kv_caches = list(kv_caches)
        self._registry = registry
        self._engine = engine
        self._shm_dir = shm_dir
        self._spec: OffloadingSpec | None = None
        self._manager: TieringOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None
        #: Copies that must run to their end even if their caller is cancelled.
        self._copies = TaskSet("KVTier", log_failures=False)
        #: Keys lookup() pinned for each request, with their slots.
        self._pins: dict[str, dict[OffloadKey, int]] = {}
        self._closed = False

    @classmethod
    async def open(
        cls,
        config: OffloadingConfig,
        kv_caches: Sequence[torch.Tensor],
        registry: CollectorRegistry | None = None,
        **kwargs: Any,
    ) -> KVTier:
        """Build and start a facade; close it with :meth:`aclose`."""
        kv = cls(config, kv_caches, registry, **kwargs)
        await kv._open()
        return kv

    async def __aenter__(self) -> KVTier:
        await self._open()
        return self

    async def _open(self) -> None:
        if self._spec is not None:
            raise KVTierError("this KVTier is already open")
        spec = OffloadingSpecFactory.create_spec(
            self.config, registry=self._registry, shm_dir=self._shm_dir
        )
        self._spec = spec
        try:
            self._manager = spec.get_manager(loop=HostLoop())
            await self._manager.start()
            self._worker = spec.create_worker(self._kv_caches, engine=self._engine)
        except BaseException:
            await spec.aclose()
            raise

    # ------------------------------------------------------------ properties

    @property
    def spec(self) -> OffloadingSpec:
        return self._require(self._spec)

    @property
    def manager(self) -> TieringOffloadingManager:
        return self._require(self._manager)

    @property
    def worker(self) -> OffloadingWorker:
        return self._require(self._worker)

    @property
    def blocks_per_chunk(self) -> int:
        return self.worker.blocks_per_chunk

    @property
    def registry(self) -> CollectorRegistry:
        """The Prometheus registry the metrics are on."""
        return self.manager.metrics.registry

    # -------------------------------------------------------------- lookups

    async def lookup(
        self, keys: Sequence[OffloadKey], req_id: str, timeout: float | None = None
    ) -> int:
        """How many leading ``keys`` are available, promoting them into the primary tier.

        Waits (without polling) while keys are being promoted or looked up in the
        secondary tiers, at most ``timeout`` seconds. The leading keys found are pinned
        in the primary tier for this request, so that promoting the rest of a long
        prefix cannot evict them, until :meth:`load` copies them or :meth:`finish`
        lets them go. Keys after the first miss are not looked up.
        """
        manager = self.manager
        req = ReqContext(req_id)
        pins = self._pins.setdefault(req_id, {})
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pending = False
            for key in keys:
                if key in pins:
                    continue
                result = manager.lookup(key, req)
                if result is LookupResult.MISS:
                    break
                if result is LookupResult.HIT:
                    pins[key] = manager.prepare_load([key], req).chunk_ids[0]
                else:
                    pending = True
            if not pending or not await self._wait_step(deadline):
                break
        hits = _leading(keys, pins)
        leading = set(keys[:hits])
        stray = [key for key in pins if key not in leading]
        if stray:
            manager.complete_load(stray, req)
            for key in stray:
                del pins[key]
        if hits:
            manager.touch(keys[:hits], req)
        return hits

    async def _wait_step(self, deadline: float | None) -> bool:
        """End the step and wait for the next completion; False once past the deadline."""
        self.manager.on_schedule_end()
        return await self._wait(deadline)

    async def _wait(self, deadline: float | None) -> bool:
        """Wait for the next completion; False once the deadline has passed."""
        if deadline is None:
            await self.manager.wait_for_completions()
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await asyncio.wait_for(self.manager.wait_for_completions(), remaining)
        return time.monotonic() < deadline

    # ---------------------------------------------------------------- copies

    async def load(self, keys: Sequence[OffloadKey], gpu_block_ids: BlockIds, req_id: str) -> int:
        """Copy the leading available ``keys`` into their GPU blocks; returns how many.

        Keys :meth:`lookup` pinned for this request are copied and unpinned; keys it
        did not pin are used if readable now. Normally all of them: fewer only if some
        were evicted since, and the caller recomputes the rest.
        """
        manager, worker = self.manager, self.worker
        gpu_ids = self._gpu_ids(keys, gpu_block_ids)
        req = ReqContext(req_id)
        pins = self._pins.get(req_id, {})
        slots: list[int] = []
        for key in keys:
            slot = pins.pop(key, None)
            if slot is None:
                if manager.readable_prefix([key]) == 0:
                    break
                slot = manager.prepare_load([key], req).chunk_ids[0]
            slots.append(slot)
        count = len(slots)
        if count == 0:
            return 0
        chosen = list(keys[:count])
        bpc = worker.blocks_per_chunk

        async def copy() -> bool:
            try:
                result = await worker.load(slots, gpu_ids[: count * bpc])
            finally:
                manager.complete_load(chosen, req)
            return result.success

        if not await self._shielded(copy()):
            raise KVTierError(f"copying {count} chunk(s) of request {req_id!r} to the GPU failed")
        return count

    async def store(
        self,
        keys: Sequence[OffloadKey],
        gpu_block_ids: BlockIds,
        req_id: str,
        timeout: float | None = None,
    ) -> int:
        """Copy the GPU blocks of the keys not stored yet into the primary tier.

        Keys go in batches of at most half the primary tier. A batch that finds no
        room waits (without polling) while copies, cascades or promotions that hold
        slots finish, at most ``timeout`` seconds; with nothing in flight that could
        free a slot, storing stops there. Returns how many keys were newly stored.
        Cascades to the secondary tiers start as soon as a batch is copied and run on;
        await :meth:`drain` to wait for them.
        """
        gpu_ids = self._gpu_ids(keys, gpu_block_ids)
        bpc = self.worker.blocks_per_chunk
        req = ReqContext(req_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        batch = max(1, self.manager.primary.num_chunks // 2)
        stored = 0
        for start in range(0, len(keys), batch):
            part = list(keys[start : start + batch])
            part_ids = gpu_ids[start * bpc : (start + len(part)) * bpc]
            count = await self._store_batch(part, part_ids, req, deadline)
            if count is None:
                break
            stored += count
        return stored

    async def _store_batch(
        self, keys: list[OffloadKey], gpu_ids: list[int], req: ReqContext, deadline: float | None
    ) -> int | None:
        manager, worker = self.manager, self.worker
        while (out := manager.prepare_store(keys, req)) is None:
            if not (self._copies or manager.has_pending_work()) or not await self._wait(deadline):
                return None
        if not out.keys_to_store:
            return 0
        bpc = worker.blocks_per_chunk
        position = {key: i for i, key in enumerate(keys)}
        blocks = [
            block
            for key in out.keys_to_store
            for block in gpu_ids[position[key] * bpc : (position[key] + 1) * bpc]
        ]

        async def copy() -> int:
            success = False
            try:
                result = await worker.store(blocks, out.store_spec.chunk_ids)
                success = result.success
            finally:
                manager.complete_store(out.keys_to_store, req, success=success)
            return len(out.keys_to_store) if success else 0

        return await self._shielded(copy())

    def finish(self, req_id: str) -> None:
        """The request is done: its pins and per-request lookup state go."""
        req = ReqContext(req_id)
        pins = self._pins.pop(req_id, None)
        if pins:
            self.manager.complete_load(list(pins), req)
        self.manager.on_request_finished(req)

    # ------------------------------------------------------------- lifecycle

    async def reset(self) -> None:
        """Empty the primary tier (secondary tiers keep their data).

        Waits for the copies and jobs in flight; pins of earlier lookups are dropped.
        """
        await self._copies.wait()
        for req_id in list(self._pins):
            self.finish(req_id)
        await self.manager.areset_cache()

    async def drain(self) -> None:
        """Wait for every copy this facade started and every cascade and promotion."""
        await self._copies.wait()
        await self.manager.drain()

    async def aclose(self) -> None:
        """Drain, then close the worker, the manager (and its tiers) and the region."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._manager is not None and self._worker is not None:
                await self.drain()
        finally:
            if self._manager is not None:
                for req_id in list(self._pins):
                    self.finish(req_id)
            if self._spec is not None:
                await self._spec.aclose()

    # --------------------------------------------------------------- helpers

    def _gpu_ids(self, keys: Sequence[OffloadKey], gpu_block_ids: BlockIds) -> list[int]:
        ids = (
            gpu_block_ids.tolist()
            if isinstance(gpu_block_ids, torch.Tensor)
            else list(gpu_block_ids)
        )
        expected = len(keys) * self.worker.blocks_per_chunk
        if len(ids) != expected:
            raise ValueError(
                f"{len(keys)} key(s) of {self.worker.blocks_per_chunk} block(s) need "
                f"{expected} gpu_block_ids, got {len(ids)}"
            )
        return [int(block) for block in ids]

    async def _shielded(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return await asyncio.shield(self._copies.spawn(coro))

    @staticmethod
    def _require(value: _T | None) -> _T:
        if value is None:
            raise KVTierError(
                "this KVTier is not open: use 'async with KVTier(...)' or KVTier.open()"
            )
        return value


def _leading(keys: Sequence[OffloadKey], present: dict[OffloadKey, int]) -> int:
    for count, key in enumerate(keys):
        if key not in present:
            return count
    return len(keys)
