"""GPU <-> primary copies for one worker rank."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence

import torch

from kvtier.errors import KVTierError
from kvtier.records import TransferResult
from kvtier.region import SharedOffloadRegion
from kvtier.resources import BlockingResource, close_all, resolve_threadsafe
from kvtier.worker.engines import COMPLETED, LOAD, STORE, CopyEngine, CopyEvent, CpuCopyEngine
from kvtier.worker.layout import ColumnLayout

__all__ = ["BlockIds", "OffloadingWorker"]

logger = logging.getLogger(__name__)

#: What callers may pass as block or chunk ids.
BlockIds = Sequence[int] | torch.Tensor

_Callback = Callable[[BaseException | None], None]


class _Waiter(BlockingResource):
    """One thread per lane that waits for its events in order and reports each one.

    Events of one lane (one CUDA stream) complete in submission order, so waiting on
    them one after another loses nothing, and a blocking wait lets the thread sleep.
    The callback runs on this thread; it must only hand results over.
    """

    def __init__(self, lane: str) -> None:
        self._queue: queue.SimpleQueue[tuple[CopyEvent, _Callback] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"kvtier-waiter-{lane}", daemon=True)
        self._thread.start()

    def watch(self, event: CopyEvent, callback: _Callback) -> None:
        self._queue.put((event, callback))

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            event, callback = item
            try:
                event.synchronize()
            except BaseException as exc:  # the job failed; its owner decides what that means
                callback(exc)
            else:
                callback(None)


class OffloadingWorker(BlockingResource):
    """Copies chunks between one rank's KV tensors and its column of the region.

    The worker owns ``region`` (this rank's mapping of it) and closes it when it closes.

    Synchronous hosts call :meth:`submit_store` / :meth:`submit_load` and poll
    :meth:`get_finished`; async hosts ``await`` :meth:`store` / :meth:`load`. Both run
    the same code. A copy is never cancelled once enqueued: cancelling a task that
    awaits one only stops the waiting, and :meth:`close` waits for every copy.

    ``gpu_block_ids`` lists ``blocks_per_chunk`` GPU block ids per chunk, in order;
    ``chunk_ids`` one primary slot per chunk. A copy may also start and end inside a
    chunk: with ``skip_blocks`` > 0 the first chunk's first ``skip_blocks`` blocks are
    left alone, and ``gpu_block_ids`` lists the blocks from there on, the last chunk
    ending wherever they end (a host whose chunks span several GPU blocks loads a
    prefix that its GPU cache holds in part).

    ``kv_caches`` are this rank's KV tensors, all with as many blocks and together
    ``kv_bytes_per_block`` bytes per block: each with the block index first and each
    block's bytes contiguous, or vLLM's per-layer ``(2, num_blocks, ...)`` tensors,
    which are read as their K and V halves (:mod:`kvtier.worker.layout`).

    Raises:
        ValueError: ``kv_caches`` fit neither layout; the message says what to pass.
    """

    def __init__(
        self,
        region: SharedOffloadRegion,
        kv_caches: Sequence[torch.Tensor],
        blocks_per_chunk: int,
        *,
        engine: CopyEngine | None = None,
    ) -> None:
        self.region = region
        self.layout = ColumnLayout(kv_caches, region.worker_column(), blocks_per_chunk)
        if self.layout.split_kv:
            logger.info(
                "rank %s: %d KV tensors read as vLLM's (2, num_blocks, ...) layout, "
                "each split into its K and V",
                region.rank,
                len(kv_caches),
            )
        if engine is None:
            engine = _default_engine(region, self.layout)
        self.engine = engine
        self.engine.bind(self.layout)
        self._finished: deque[TransferResult] = deque()
        # Started now for the two lanes every engine has: a thread started while a copy
        # thread runs waits for the GIL (up to the switch interval) on the caller's side.
        self._waiters: dict[str, _Waiter] = {lane: _Waiter(lane) for lane in (STORE, LOAD)}
        self._inflight = 0
        self._inflight_ids: set[int] = set()
        self._idle = threading.Condition()
        self._ids = itertools.count(1 << 62)
        self._closed = False

    @property
    def blocks_per_chunk(self) -> int:
        return self.layout.blocks_per_chunk

    @property
    def inflight(self) -> int:
        """Jobs whose copies have not completed yet."""
        return self._inflight

    # ------------------------------------------------------------ sync API

    def submit_store(
        self, job_id: int, gpu_block_ids: BlockIds, chunk_ids: BlockIds, *, skip_blocks: int = 0
    ) -> None:
        """Start copying GPU blocks into slots; the result comes from :meth:`get_finished`."""
        self._submit(job_id, STORE, gpu_block_ids, chunk_ids, self._finished.append, skip_blocks)

    def submit_load(
        self, job_id: int, chunk_ids: BlockIds, gpu_block_ids: BlockIds, *, skip_blocks: int = 0
    ) -> None:
        """Start copying slots into GPU blocks; the result comes from :meth:`get_finished`."""
        self._submit(job_id, LOAD, gpu_block_ids, chunk_ids, self._finished.append, skip_blocks)

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> bool:
        """Block until the submitted jobs ``job_ids`` have completed; False on timeout.

        Their results still come from :meth:`get_finished`.
        """
        ids = set(job_ids)
        with self._idle:
            return self._idle.wait_for(lambda: ids.isdisjoint(self._inflight_ids), timeout)

    def get_finished(self) -> list[TransferResult]:
        """Results of submitted jobs that completed since the last call."""
        results: list[TransferResult] = []
        while self._finished:
            results.append(self._finished.popleft())
        return results

    # ----------------------------------------------------------- async API

    async def store(
        self, gpu_block_ids: BlockIds, chunk_ids: BlockIds, *, skip_blocks: int = 0
    ) -> TransferResult:
        """Copy GPU blocks into slots and wait, without blocking the loop, until done."""
        return await self._run(STORE, gpu_block_ids, chunk_ids, skip_blocks)

    async def load(
        self, chunk_ids: BlockIds, gpu_block_ids: BlockIds, *, skip_blocks: int = 0
    ) -> TransferResult:
        """Copy slots into GPU blocks and wait, without blocking the loop, until done."""
        return await self._run(LOAD, gpu_block_ids, chunk_ids, skip_blocks)

    async def _run(
        self, direction: str, gpu_block_ids: BlockIds, chunk_ids: BlockIds, skip_blocks: int
    ) -> TransferResult:
        future: asyncio.Future[TransferResult] = asyncio.get_running_loop().create_future()

        def deliver(result: TransferResult) -> None:
            resolve_threadsafe(future, result)

        self._submit(next(self._ids), direction, gpu_block_ids, chunk_ids, deliver, skip_blocks)
        return await future

    # -------------------------------------------------------------- closing

    def close(self) -> None:
        """Wait for every copy, stop the waiter threads, release the engine and region.

        Idempotent; a part that fails to close is logged and the rest still close.
        Blocks the calling thread; async hosts ``await`` :meth:`aclose`.
        """
        if self._closed:
            return
        self._closed = True
        with self._idle:
            self._idle.wait_for(lambda: self._inflight == 0)
        label = f"rank {self.region.rank} worker"
        close_all(label, [*self._waiters.values(), self.engine])
        self._waiters.clear()
        # The layout's tensors view the region's mapping, which cannot be unmapped
        # while they live.
        del self.layout
        close_all(label, [self.region])

    # -------------------------------------------------------------- internals

    def _submit(
        self,
        job_id: int,
        direction: str,
        gpu_block_ids: BlockIds,
        chunk_ids: BlockIds,
        report: Callable[[TransferResult], None],
        skip_blocks: int = 0,
    ) -> None:
        if self._closed:
            raise KVTierError("the worker is closed")
        gpu_ids, slots, gpu_values, slot_values = self._check_ids(
            direction, gpu_block_ids, chunk_ids, skip_blocks
        )
        nbytes = len(gpu_values) * (self.layout.column_bytes // self.layout.blocks_per_chunk)
        started = time.perf_counter()
        if nbytes == 0:
            report(TransferResult(job_id, True, 0, 0.0))
            return
        try:
            if skip_blocks:
                gpu_ids, slots = self._copy_partial_chunks(
                    direction, gpu_ids, slots, gpu_values, slot_values, skip_blocks
                )
            if not slots.numel():
                event = COMPLETED
            elif direction == STORE:
                event = self.engine.store(gpu_ids, slots)
            else:
                event = self.engine.load(slots, gpu_ids)
        except Exception:
            logger.exception(
                "%s job %d of %d chunks failed to start", direction, job_id, slots.numel()
            )
            report(TransferResult(job_id, False, nbytes, time.perf_counter() - started))
            return

        def finish(error: BaseException | None) -> None:
            elapsed = time.perf_counter() - started
            if error is not None:
                logger.error(
                    "%s job %d of %d chunks failed: %s", direction, job_id, slots.numel(), error
                )
            report(TransferResult(job_id, error is None, nbytes, elapsed))
            with self._idle:
                self._inflight -= 1
                self._inflight_ids.discard(job_id)
                self._idle.notify_all()

        with self._idle:
            self._inflight += 1
            self._inflight_ids.add(job_id)
        if event is COMPLETED:
            finish(None)
            return
        if event.query():
            try:
                event.synchronize()  # done: returns at once, or raises what failed
            except BaseException as exc:  # the job failed; reported, not raised
                finish(exc)
            else:
                finish(None)
            return
        waiter = self._waiters.get(event.lane)
        if waiter is None:
            waiter = self._waiters[event.lane] = _Waiter(event.lane)
        waiter.watch(event, finish)

    def _check_ids(
        self, direction: str, gpu_block_ids: BlockIds, chunk_ids: BlockIds, skip_blocks: int
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """The ids as tensors for the engine and as Python ints, checked.

        A job without ``skip_blocks`` covers whole chunks; one with it starts that many
        blocks into its first chunk and may end inside its last.
        """
        # The checks read the ids as Python ints: they run on the event loop, and each
        # torch operation there would let the interpreter lock go to a busy copy or I/O
        # thread, costing the loop up to a switch interval (5 ms) to get it back.
        gpu_ids, gpu_values = _as_ids("gpu_block_ids", gpu_block_ids)
        slots, slot_values = _as_ids("chunk_ids", chunk_ids)
        layout = self.layout
        bpc = layout.blocks_per_chunk
        if not 0 <= skip_blocks < bpc:
            raise ValueError(f"skip_blocks must lie in [0, {bpc}), got {skip_blocks}")
        if skip_blocks == 0:
            expected = slots.numel() * bpc
            if gpu_ids.numel() != expected:
                raise ValueError(
                    f"{slots.numel()} chunk(s) of {bpc} block(s) need "
                    f"{expected} gpu_block_ids, got {gpu_ids.numel()}"
                )
        elif -(-(skip_blocks + gpu_ids.numel()) // bpc) != slots.numel() or not gpu_ids.numel():
            raise ValueError(
                f"{gpu_ids.numel()} gpu_block_ids after skipping {skip_blocks} block(s) span "
                f"{-(-(skip_blocks + gpu_ids.numel()) // bpc)} chunk(s) of {bpc} block(s), "
                f"but {slots.numel()} chunk_ids were given"
            )
        _check_range("chunk_ids", slot_values, layout.num_chunks)
        _check_range("gpu_block_ids", gpu_values, layout.num_gpu_blocks)
        # A store writing one slot twice, or a load writing one GPU block twice, would
        # leave bytes that depend on copy order.
        written, name = (
            (slot_values, "chunk_ids") if direction == STORE else (gpu_values, "gpu_block_ids")
        )
        if len(set(written)) != len(written):
            raise ValueError(f"{name} of a {direction} must not repeat an id")
        return gpu_ids, slots, gpu_values, slot_values

    def _copy_partial_chunks(
        self,
        direction: str,
        gpu_ids: torch.Tensor,
        slots: torch.Tensor,
        gpu_values: list[int],
        slot_values: list[int],
        skip_blocks: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the blocks of chunks a job starting ``skip_blocks`` into its first chunk
        covers only in part; the whole chunks left.

        Only the first chunk and the last can be partial, so these few blocks are
        copied one by one and synchronously, and the engine (whose copies move whole
        chunks) gets the rest.
        """
        bpc = self.layout.blocks_per_chunk
        end = skip_blocks + len(gpu_values)
        last_whole = end // bpc  # chunks [1, last_whole) are covered whole
        partial = [
            (slot_values[position // bpc], position % bpc, gpu_values[position - skip_blocks])
            for position in range(skip_blocks, end)
            if not 1 <= position // bpc < last_whole
        ]
        for part in self.layout.slices:
            for slot, offset, block in partial:
                if direction == STORE:
                    part.region_view[slot, offset].copy_(part.blocks[block])
                else:
                    part.blocks[block].copy_(part.region_view[slot, offset])
        if last_whole <= 1:
            return gpu_ids[:0], slots[:0]
        start = bpc - skip_blocks
        return gpu_ids[start : start + (last_whole - 1) * bpc], slots[1:last_whole]


def _as_ids(name: str, ids: BlockIds) -> tuple[torch.Tensor, list[int]]:
    """``ids`` as the int64 tensor the copy engines index with, and as Python ints."""
    try:
        tensor = torch.as_tensor(ids, dtype=torch.int64, device="cpu")
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name} must be a sequence of integers: {exc}") from exc
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(tensor.shape)}")
    values: list[int] = tensor.tolist()
    return tensor, values


def _check_range(name: str, ids: list[int], limit: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= limit):
        raise ValueError(f"{name} must lie in [0, {limit}), got {min(ids)}..{max(ids)}")


def _default_engine(region: SharedOffloadRegion, layout: ColumnLayout) -> CopyEngine:
    if layout.device.type == "cuda":
        from kvtier.worker.cuda import CudaCopyEngine

        return CudaCopyEngine(region)
    if layout.device.type != "cpu":
        raise ValueError(f"no copy engine for KV tensors on {layout.device}; pass engine=")
    return CpuCopyEngine()
