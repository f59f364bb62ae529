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
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvtier._logs import describe_failure
from kvtier.errors import KVTierError
from kvtier.records import TransferResult
from kvtier.region import SharedOffloadRegion
from kvtier.resources import BlockingResource, close_all, resolve_threadsafe
from kvtier.worker.engines import COMPLETED, LOAD, STORE, CopyEngine, CopyEvent, CpuCopyEngine
from kvtier.worker.layout import ColumnLayout, PageMap

__all__ = ["BlockIds", "GroupSplit", "OffloadingWorker"]

logger = logging.getLogger(__name__)

#: What callers may pass as block or chunk ids.
BlockIds = Sequence[int] | torch.Tensor

_Callback = Callable[[BaseException | None], None]


@dataclass(frozen=True)
class GroupSplit:
    """How one copy job divides among the worker's KV-cache groups.

    The job's ``gpu_block_ids`` list the blocks of group 0, then group 1, and so on:
    ``sizes[g]`` of them belong to group ``g`` (0: the group takes no part). Group
    ``g``'s blocks start ``skips[g]`` blocks into its first chunk and may end inside
    its last, so they span ``ceil((skips[g] + sizes[g]) / blocks_per_chunk)`` of the
    job's ``chunk_ids``, again group after group. This is how vLLM's connector names
    a copy (``GPULoadStoreSpec.group_sizes``, and ``block_indices`` modulo the
    blocks per chunk).
    """

    sizes: Sequence[int]
    skips: Sequence[int]


class _Part(NamedTuple):
    """One group's share of a job: its ids as tensors and as Python ints.

    A tuple, not a frozen dataclass: every job builds one, and a frozen dataclass
    costs several times as much to make.
    """

    group: int
    gpu_ids: torch.Tensor
    slots: torch.Tensor
    gpu_values: list[int]
    slot_values: list[int]
    skip_blocks: int


class _AllEvents(CopyEvent):
    """The copies of one job's groups: complete once every one of them is."""

    def __init__(self, events: list[CopyEvent]) -> None:
        self._events = events
        # Every event of a job is on the job's direction lane, so completing them in
        # order keeps the lane's submission order.
        self.lane = events[-1].lane

    def query(self) -> bool:
        return all(event.query() for event in self._events)

    def synchronize(self) -> None:
        # Wait for all of them even after one failed: the job ends only when no copy
        # of it still runs.
        errors = [error for event in self._events if (error := _synchronize(event))]
        if errors:
            raise errors[0]


def _synchronize(event: CopyEvent) -> BaseException | None:
    """Wait for ``event``; what its copies raised, if they failed."""
    try:
        event.synchronize()
    except BaseException as exc:  # handed back: the caller raises it once all ended
        return exc
    return None


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

    A model with several KV-cache groups passes ``groups``: per group, the indices of
    the ``kv_caches`` its layers use (they may share tensors with other groups). Each
    slot then holds one chunk of one group, and every copy names how it divides among
    the groups with a :class:`GroupSplit`.

    In a canonical layout ``pages`` gives each KV tensor's
    :class:`~kvtier.worker.layout.PageMap`: the worker then copies its fragments of the
    shared pages. ``stores=False`` makes a worker whose bytes another rank writes (a
    replicated layout's ranks but the first) complete its stores without copying.

    Raises:
        ValueError: ``kv_caches`` fit neither layout, or ``groups`` names tensors that
            are not there; the message says what to pass.
    """

    def __init__(
        self,
        region: SharedOffloadRegion,
        kv_caches: Sequence[torch.Tensor],
        blocks_per_chunk: int,
        *,
        engine: CopyEngine | None = None,
        groups: Sequence[Sequence[int]] | None = None,
        pages: Sequence[PageMap] | None = None,
        stores: bool = True,
    ) -> None:
        self.region = region
        self.layout = ColumnLayout(
            kv_caches, region.worker_column(), blocks_per_chunk, groups, pages
        )
        self._stores = stores
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
        self,
        job_id: int,
        gpu_block_ids: BlockIds,
        chunk_ids: BlockIds,
        *,
        skip_blocks: int = 0,
        groups: GroupSplit | None = None,
    ) -> None:
        """Start copying GPU blocks into slots; the result comes from :meth:`get_finished`.

        ``groups`` (a worker built with several KV-cache groups needs it; then
        ``skip_blocks`` is its ``skips``) says which blocks and slots are whose.
        """
        self._submit(
            job_id, STORE, gpu_block_ids, chunk_ids, self._finished.append, skip_blocks, groups
        )

    def submit_load(
        self,
        job_id: int,
        chunk_ids: BlockIds,
        gpu_block_ids: BlockIds,
        *,
        skip_blocks: int = 0,
        groups: GroupSplit | None = None,
    ) -> None:
        """Start copying slots into GPU blocks; the result comes from :meth:`get_finished`.

        ``groups`` as for :meth:`submit_store`.
        """
        self._submit(
            job_id, LOAD, gpu_block_ids, chunk_ids, self._finished.append, skip_blocks, groups
        )

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
        self,
        gpu_block_ids: BlockIds,
        chunk_ids: BlockIds,
        *,
        skip_blocks: int = 0,
        groups: GroupSplit | None = None,
    ) -> TransferResult:
        """Copy GPU blocks into slots and wait, without blocking the loop, until done."""
        return await self._run(STORE, gpu_block_ids, chunk_ids, skip_blocks, groups)

    async def load(
        self,
        chunk_ids: BlockIds,
        gpu_block_ids: BlockIds,
        *,
        skip_blocks: int = 0,
        groups: GroupSplit | None = None,
    ) -> TransferResult:
        """Copy slots into GPU blocks and wait, without blocking the loop, until done."""
        return await self._run(LOAD, gpu_block_ids, chunk_ids, skip_blocks, groups)

    async def _run(
        self,
        direction: str,
        gpu_block_ids: BlockIds,
        chunk_ids: BlockIds,
        skip_blocks: int,
        groups: GroupSplit | None,
    ) -> TransferResult:
        future: asyncio.Future[TransferResult] = asyncio.get_running_loop().create_future()

        def deliver(result: TransferResult) -> None:
            resolve_threadsafe(future, result)

        self._submit(
            next(self._ids), direction, gpu_block_ids, chunk_ids, deliver, skip_blocks, groups
        )
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
        groups: GroupSplit | None = None,
    ) -> None:
        if self._closed:
            raise KVTierError("the worker is closed")
        layout = self.layout
        if groups is None:
            if len(layout.groups) != 1:
                raise ValueError(
                    f"this worker's KV tensors form {len(layout.groups)} KV-cache groups: "
                    "a copy must say which blocks are whose (groups=GroupSplit(...))"
                )
            gpu_ids, slots, gpu_values, slot_values = self._check_ids(
                direction, gpu_block_ids, chunk_ids, skip_blocks
            )
            parts: Sequence[_Part] = (
                _Part(0, gpu_ids, slots, gpu_values, slot_values, skip_blocks),
            )
            nbytes = len(gpu_values) * layout.group_block_bytes[0]
            num_chunks = len(slot_values)
        else:
            parts, nbytes, num_chunks = self._split_groups(
                direction, gpu_block_ids, chunk_ids, groups
            )
        started = time.perf_counter()
        if nbytes == 0 or (direction == STORE and not self._stores):
            report(TransferResult(job_id, True, 0, 0.0))
            return
        try:
            events = [event for part in parts if (event := self._start(direction, part))]
        except Exception as exc:
            logger.error(
                "%s job %d of %d chunks failed to start: %s",
                direction,
                job_id,
                num_chunks,
                describe_failure(exc),
            )
            report(TransferResult(job_id, False, nbytes, time.perf_counter() - started))
            return
        if not events:
            event = COMPLETED
        elif len(events) == 1:
            event = events[0]
        else:
            event = _AllEvents(events)

        def finish(error: BaseException | None) -> None:
            elapsed = time.perf_counter() - started
            if error is not None:
                logger.error(
                    "%s job %d of %d chunks failed: %s", direction, job_id, num_chunks, error
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

    def _start(self, direction: str, part: _Part) -> CopyEvent | None:
        """Enqueue one group's copies; None when none is left for the engine."""
        gpu_ids, slots = part.gpu_ids, part.slots
        if part.skip_blocks or len(part.gpu_values) % self.layout.blocks_per_chunk:
            gpu_ids, slots = self._copy_partial_chunks(direction, part)
        if not slots.numel():
            return None
        if direction == STORE:
            return self.engine.store(gpu_ids, slots, group=part.group)
        return self.engine.load(slots, gpu_ids, group=part.group)

    def _split_groups(
        self, direction: str, gpu_block_ids: BlockIds, chunk_ids: BlockIds, groups: GroupSplit
    ) -> tuple[list[_Part], int, int]:
        """Each group's share of a job, checked; the bytes it moves; its chunk count."""
        gpu_ids, gpu_values = _as_ids("gpu_block_ids", gpu_block_ids)
        slots, slot_values = _as_ids("chunk_ids", chunk_ids)
        layout = self.layout
        bpc = layout.blocks_per_chunk
        num_groups = len(layout.groups)
        if len(groups.sizes) != num_groups or len(groups.skips) != num_groups:
            raise ValueError(
                f"this worker has {num_groups} KV-cache group(s); the copy names "
                f"{len(groups.sizes)} group sizes and {len(groups.skips)} skips"
            )
        if sum(groups.sizes) != len(gpu_values):
            raise ValueError(
                f"the group sizes add up to {sum(groups.sizes)} blocks, "
                f"but {len(gpu_values)} gpu_block_ids were given"
            )
        parts: list[_Part] = []
        nbytes = block = slot = 0
        for group, (size, skip) in enumerate(zip(groups.sizes, groups.skips, strict=True)):
            if size < 0:
                raise ValueError(f"group {group}'s size must be >= 0, got {size}")
            if not size:
                continue
            if not 0 <= skip < bpc:
                raise ValueError(f"group {group}'s skip must lie in [0, {bpc}), got {skip}")
            count = -(-(skip + size) // bpc)
            parts.append(
                _Part(
                    group,
                    gpu_ids[block : block + size],
                    slots[slot : slot + count],
                    gpu_values[block : block + size],
                    slot_values[slot : slot + count],
                    skip,
                )
            )
            nbytes += size * layout.group_block_bytes[group]
            block += size
            slot += count
        if slot != len(slot_values):
            raise ValueError(
                f"the groups' blocks span {slot} chunk(s) of {bpc} block(s), "
                f"but {len(slot_values)} chunk_ids were given"
            )
        _check_targets(direction, layout, gpu_values, slot_values)
        return parts, nbytes, len(slot_values)

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
        _check_targets(direction, layout, gpu_values, slot_values)
        return gpu_ids, slots, gpu_values, slot_values

    def _copy_partial_chunks(
        self, direction: str, part: _Part
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the blocks of the chunks a group's share of a job covers only in part
        (it starts ``skip_blocks`` into its first chunk, or ends inside its last); the
        whole chunks left.

        Only the first chunk and the last can be partial, so these few blocks are
        copied one by one and synchronously, and the engine (whose copies move whole
        chunks) gets the rest.
        """
        gpu_values, slot_values, skip_blocks = part.gpu_values, part.slot_values, part.skip_blocks
        bpc = self.layout.blocks_per_chunk
        end = skip_blocks + len(gpu_values)
        last_whole = end // bpc  # chunks [1, last_whole) are covered whole
        partial = [
            (slot_values[position // bpc], position % bpc, gpu_values[position - skip_blocks])
            for position in range(skip_blocks, end)
            if not 1 <= position // bpc < last_whole
        ]
        for tensor in self.layout.groups[part.group]:
            for slot, offset, block in partial:
                if direction == LOAD:
                    for blocks, region in tensor.runs:
                        blocks[block].copy_(region[slot, offset])
                elif tensor.page is None or tensor.page.writes(slot * bpc + offset):
                    for blocks, region in tensor.runs:
                        region[slot, offset].copy_(blocks[block])
        if last_whole <= 1:
            return part.gpu_ids[:0], part.slots[:0]
        start = bpc - skip_blocks
        return part.gpu_ids[start : start + (last_whole - 1) * bpc], part.slots[1:last_whole]


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


def _check_targets(
    direction: str, layout: ColumnLayout, gpu_values: list[int], slot_values: list[int]
) -> None:
    """Every id in range, and none written twice: a store writing one slot twice, or a
    load writing one GPU block twice, would leave bytes that depend on copy order."""
    _check_range("chunk_ids", slot_values, layout.num_chunks)
    _check_range("gpu_block_ids", gpu_values, layout.num_gpu_blocks)
    written, name = (
        (slot_values, "chunk_ids") if direction == STORE else (gpu_values, "gpu_block_ids")
    )
    if len(set(written)) != len(written):
        raise ValueError(f"{name} of a {direction} must not repeat an id")


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
