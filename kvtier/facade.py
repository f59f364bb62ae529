"""``KVTier``: the await-based face of kvtier for an async serving stack.

A thin shell over the host layer (:mod:`kvtier.hosts`): its fence, its waits for tier
work, its store batches and its request records are the page store's too. What is the
facade's own is the worker's GPU copies, run to their end even if their caller goes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import torch
from prometheus_client import CollectorRegistry

from kvtier._logs import describe_failure
from kvtier.config import OffloadingConfig
from kvtier.errors import KVTierError
from kvtier.hosts.fence import Fence
from kvtier.hosts.requests import Claim, Request, Requests
from kvtier.hosts.stores import StoreRoom
from kvtier.hosts.waits import Step, step_until
from kvtier.keys import OffloadKey
from kvtier.records import PrepareStoreOutput, ReqContext
from kvtier.region import DEFAULT_SHM_DIR
from kvtier.resources import AsyncResource, TaskSet
from kvtier.specs.base import OffloadingSpec
from kvtier.specs.factory import OffloadingSpecFactory
from kvtier.tiering.loop import HostLoop
from kvtier.tiering.manager import TieringOffloadingManager
from kvtier.worker.engines import CopyEngine
from kvtier.worker.worker import BlockIds, OffloadingWorker

__all__ = ["KVTier"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class KVTier(AsyncResource):
    """The manager and one worker, driven through ``await``.

    ``gpu_block_ids`` arguments hold ``blocks_per_chunk`` GPU block ids per key, in
    order. The facade drives the scheduler step protocol itself (lookup, end of step,
    waiting for completions) and never busy-waits. It must be used from one event loop,
    the one it was opened on; the tiers run on that loop too.

    A store or load keeps running to its end even if the task awaiting it is
    cancelled (a half-copied slot would otherwise be freed or served):
    :meth:`drain` and :meth:`aclose` wait for them. :meth:`reset` and :meth:`aclose`
    fence every other call: they wait for the copies in flight, make waiting lookups
    give up, and hold new calls back until they are done. Every call on a closed
    facade raises :class:`~kvtier.errors.KVTierError`.
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
        self._requests: Requests | None = None
        self._stores: StoreRoom | None = None
        self._fence = Fence()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

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
        if self._closed:
            raise KVTierError("this KVTier is closed; open a new one")
        if self._spec is not None:
            raise KVTierError("this KVTier is already open")
        spec = OffloadingSpecFactory.create_spec(
            self.config, registry=self._registry, shm_dir=self._shm_dir
        )
        self._spec = spec
        self._loop = asyncio.get_running_loop()
        try:
            manager = self._manager = spec.get_manager(loop=HostLoop())
            await manager.start()
            self._worker = spec.create_worker(self._kv_caches, engine=self._engine)
            self._requests = Requests(manager)
            # Copies in flight hold slots: a load's pins, a store's slots being written.
            self._stores = StoreRoom(manager, self._requests, in_flight=lambda: bool(self._copies))
        except BaseException:
            self._closed = True
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

    @property
    def num_chunks(self) -> int:
        """Chunks the primary tier holds (its slots)."""
        return self.manager.host.num_chunks

    @property
    def recompute_s_per_chunk(self) -> float | None:
        """What recomputing one chunk costs the host, in seconds (None: not known).

        Set it as the host measures its prefill (``PrefixCache.observe_prefill`` does):
        a secondary hit whose promotion would take longer is a miss, and a
        :meth:`lookup` waits no longer than recomputing its keys would take. Setting a
        value that is not a positive number or None raises ``ValueError``.
        """
        return self.manager.host.recompute_s_per_chunk

    @recompute_s_per_chunk.setter
    def recompute_s_per_chunk(self, seconds: float | None) -> None:
        self.manager.host.set_recompute_cost(seconds)

    @property
    def closed(self) -> bool:
        return self._closed

    # -------------------------------------------------------------- lookups

    async def lookup(
        self,
        keys: Sequence[OffloadKey],
        req_id: str,
        timeout: float | None = None,
        *,
        claim: bool = False,
    ) -> int:
        """How many leading ``keys`` are available, promoting them into the primary tier.

        Waits (without polling) while keys are being promoted or looked up in the
        secondary tiers, at most ``timeout`` seconds, and, once the host's recompute
        cost is known (:attr:`recompute_s_per_chunk`),
        never longer than recomputing ``keys`` would take, nor, for chunks promoted
        from a tier kvtier has not measured yet, longer than a tenth of recomputing
        them (the promotion goes on and measures the tier): then the chunks still on
        their way are misses for this request from now on. The leading keys found are pinned
        in the primary tier for this request, so that promoting the rest of a long
        prefix cannot evict them, until :meth:`load` copies them or :meth:`finish`
        lets them go. Keys after the first miss are not looked up. A lookup that is
        waiting when the request finishes or the cache is reset answers 0.

        Concurrent requests that share a prefix compute it once: with ``claim`` the
        request says it will compute and :meth:`store` the keys after the hits it gets
        (those no other request claimed); until it stores them or finishes, another
        request's lookup whose first miss is one of them waits for them (within its
        ``timeout``) rather than returning early to recompute them. A request that
        holds claims of its own never waits for another's, so two cannot wait on each
        other.

        Raises:
            KVTierError: the facade is closed, or was closed while this call waited.
        """
        async with self._fence.operation(self._check_open):
            requests = self._require(self._requests)
            request = requests.of(req_id)
            # Waiting longer than recomputing could only make the request slower. The
            # manager bounds the wait for promotions (pending_remaining_s, in _find);
            # this bounds the rest: a tier still being asked, a slow claimer.
            recompute = self.recompute_s_per_chunk
            if recompute is not None:
                bound = len(keys) * recompute
                timeout = bound if timeout is None else min(timeout, bound)
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                hits = await self._find(keys, request, deadline)
                if hits == len(keys) or request.ended or self._fence.raised:
                    break
                other = requests.claimant(keys[hits])
                if other is None or other.owner == req_id or request.claims:
                    break
                if not await self._wait_for(other, deadline):
                    break
            if hits and (request.ended or self._fence.raised):
                # Gave up waiting for a claim because the request finished or a reset
                # began: the hits it had are not this request's any more.
                self.manager.host.release_except(request.req, ())
                hits = 0
            if claim:
                requests.claim(request, keys[hits:])
        self._check_open()
        return hits

    def claim(self, keys: Sequence[OffloadKey], req_id: str) -> int:
        """Say that ``req_id`` computes and stores ``keys``, as :meth:`lookup` with
        ``claim`` does for the keys after its hits.

        For a host that looks a long prefix up in windows: the window that misses
        claims its own keys, and this claims the windows after it, which the request
        computes too. Keys another request claimed stay that request's. A request
        finishing (or storing the keys) releases its claims; one that has not looked
        anything up, or has finished, claims nothing (nobody would release it).

        Returns:
            How many of ``keys`` the request newly claimed.

        Raises:
            KVTierError: the facade is closed.
        """
        self._check_open()
        requests = self._require(self._requests)
        request = requests.get(req_id)
        return 0 if request is None else requests.claim(request, keys)

    async def _wait_for(self, claim: Claim, deadline: float | None) -> bool:
        """Wait until a claim is released; False past the deadline or once fenced."""
        await self._fence.wait_unless_raised(claim.done.wait(), deadline)
        return claim.done.is_set() and not self._fence.raised

    async def _find(
        self, keys: Sequence[OffloadKey], request: Request, deadline: float | None
    ) -> int:
        manager, fence = self.manager, self._fence
        host, req = manager.host, request.req

        def step() -> Step:
            if request.ended or fence.raised or not host.lookup_prefix(keys, req).pending:
                return Step.DONE
            manager.on_schedule_end()
            return Step.WAIT

        # The wait ends at the manager's deadline for the request too: what its
        # promotions are worth waiting for (a tier not measured yet gets a small part).
        found = await step_until(host, step, deadline=deadline, req=req, fence=fence)
        if request.ended:
            return 0  # finished meanwhile: its pins are gone
        if fence.raised:
            host.release_except(req, ())
            return 0
        if not found:
            # The deadline passed: the request goes on without what is still on its
            # way (those chunks are misses now; queued promotions free slots).
            host.expire_pending(req)
        held = host.held(req)
        hits = _leading(keys, held)
        host.release_except(req, set(keys[:hits]))
        if hits:
            manager.touch(keys[:hits], req)
        # The lookup ends a step: what it queued for the tiers (a lookup that gave up
        # waiting may leave some) goes now, not at the next call that steps.
        manager.on_schedule_end()
        return hits

    # ---------------------------------------------------------------- copies

    async def load(self, keys: Sequence[OffloadKey], gpu_block_ids: BlockIds, req_id: str) -> int:
        """Copy the leading available ``keys`` into their GPU blocks; returns how many.

        Keys :meth:`lookup` pinned for this request are copied and unpinned; keys it
        did not pin are used if readable now. Normally all of them: fewer only if some
        were evicted since, and the caller recomputes the rest.

        Raises:
            KVTierError: the facade is closed, or the copy failed.
        """
        async with self._fence.operation(self._check_open):
            return await self._load(keys, gpu_block_ids, req_id)

    async def _load(self, keys: Sequence[OffloadKey], gpu_block_ids: BlockIds, req_id: str) -> int:
        manager, worker = self.manager, self.worker
        gpu_ids = self._gpu_ids(keys, gpu_block_ids)
        req = ReqContext(req_id)
        pins = manager.host.held(req)
        slots: list[int] = []
        for key in keys:
            slot = pins.get(key)
            if slot is None:
                if manager.host.readable_prefix([key]) == 0:
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
        free a slot, storing stops there (so it does when a reset or close begins).
        Returns how many keys were newly stored. Cascades to the secondary tiers start
        as soon as a batch is copied and run on; await :meth:`drain` to wait for them.

        Raises:
            KVTierError: the facade is closed.
        """
        async with self._fence.operation(self._check_open):
            worker, requests = self.worker, self._require(self._requests)
            gpu_ids = self._gpu_ids(keys, gpu_block_ids)
            bpc = worker.blocks_per_chunk

            async def copy(out: PrepareStoreOutput, part: range) -> bool:
                position = {keys[i]: i for i in part}
                blocks = [
                    block
                    for key in out.keys_to_store
                    for block in gpu_ids[position[key] * bpc : (position[key] + 1) * bpc]
                ]
                return (await worker.store(blocks, out.store_spec.chunk_ids)).success

            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                stored = await self._require(self._stores).store(
                    keys,
                    ReqContext(req_id),
                    copy,
                    shield=self._shielded,
                    deadline=deadline,
                    fence=self._fence,
                )
            finally:
                request = requests.get(req_id)
                if request is not None and request.claims:
                    # Stored (readable, or on their way) or not: nobody waits for them.
                    requests.release_claims(request, keys)
            return stored.written

    def finish(self, req_id: str) -> None:
        """The request is done: its pins and per-request lookup state go.

        A lookup of the request still waiting for tier work answers 0.

        Raises:
            KVTierError: the facade is closed.
        """
        self._check_open()
        self._require(self._requests).end(req_id)

    # ------------------------------------------------------------- lifecycle

    async def reset(self) -> None:
        """Empty the primary tier (secondary tiers keep their data; their back-pressure
        starts afresh).

        Waits for the copies and jobs in flight; lookups waiting for tier work answer
        0, the pins of earlier lookups are dropped, and calls made meanwhile wait.

        Raises:
            KVTierError: the facade is closed.
        """
        self._check_open()
        async with self._fence.fenced():
            await self._reset()

    async def clear(self) -> list[str]:
        """Drop every chunk: empty the primary tier as :meth:`reset` does, then ask each
        secondary tier to delete what it holds for this namespace (an fs tier's files,
        an s3 tier's objects; a p2p tier holds none of its own, and its peers keep
        theirs). Other engines sharing a directory or bucket lose those chunks too.

        Returns:
            The labels of the tiers that kept chunks: a tier that cannot clear (a
            plugin without :meth:`~kvtier.SecondaryTier.clear`), failed to, or ran
            past its job timeout. Empty when everything is gone.

        Raises:
            KVTierError: the facade is closed.
        """
        self._check_open()
        async with self._fence.fenced():
            await self._reset()
            return await self.manager.aclear_tiers()

    async def _reset(self) -> None:
        self._check_open()
        await self._copies.wait()
        self._require(self._requests).end_all()
        await self.manager.areset_cache()

    async def drain(self) -> None:
        """Wait for every copy this facade started and every cascade and promotion.

        Raises:
            KVTierError: the facade is closed.
        """
        self._check_open()
        await self._copies.wait()
        await self.manager.drain()

    async def aclose(self) -> None:
        """Let the calls in flight end, drain, then close the worker, the manager (and
        its tiers) and the region. Idempotent; whatever fails on the way is logged and
        everything is still closed. ``close()`` is the same for another thread: it runs
        on the loop the facade was opened on."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._manager is not None and self._worker is not None:
                async with self._fence.fenced():
                    await self._close_requests()
        finally:
            if self._spec is not None:
                await self._spec.aclose()

    def _home_loop(self) -> asyncio.AbstractEventLoop | None:
        # The fence, the copies and the tiers live on the loop the facade was opened on.
        return self._loop

    async def _close_requests(self) -> None:
        try:
            await self._copies.wait()
            await self.manager.drain()
            self._require(self._requests).end_all()
        except Exception as exc:
            logger.error(
                "draining the KVTier before closing it failed; closing anyway: %s",
                describe_failure(exc),
            )

    # --------------------------------------------------------------- helpers

    def _check_open(self) -> None:
        if self._closed:
            raise KVTierError("this KVTier is closed")
        if self._spec is None:
            raise KVTierError(
                "this KVTier is not open: use 'async with KVTier(...)' or KVTier.open()"
            )

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
