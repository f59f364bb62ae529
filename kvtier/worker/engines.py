"""Copy engines: what actually moves bytes between KV tensors and the region.

An engine enqueues the copies of one job and returns a :class:`CopyEvent` that says
when they are done. The worker owns everything around it (argument checks, timing,
waiting, results), so an engine is only the copies.

- :class:`CpuCopyEngine` copies at once on the calling thread (CPU tensors; also the
  stand-in for a GPU when CUDA is absent).
- :class:`ThreadedCopyEngine` copies on background threads, optionally held back by a
  gate or slowed down, so the waiting, cancellation and shutdown paths of the worker
  run in tests exactly as they do with a GPU.
- :class:`~kvtier.worker.cuda.CudaCopyEngine` enqueues on dedicated CUDA streams.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from kvtier.worker.layout import ColumnLayout

__all__ = [
    "COMPLETED",
    "CopyEngine",
    "CopyEvent",
    "CpuCopyEngine",
    "ThreadedCopyEngine",
]

#: The two directions; each has its own queue (stream, thread) so loads never wait
#: behind stores.
STORE = "store"
LOAD = "load"


class CopyEvent(ABC):
    """Completion of one job's copies.

    ``lane`` names the queue the job ran on; jobs of one lane complete in submission
    order, which lets one waiter thread per lane wait for them in turn.
    """

    lane: str

    @abstractmethod
    def query(self) -> bool:
        """True once the copies are complete. Never blocks."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until the copies are complete.

        Raises whatever made the copies fail.
        """


class _CompletedEvent(CopyEvent):
    lane = "done"

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


#: The event of copies that finished before the engine returned.
COMPLETED: CopyEvent = _CompletedEvent()


class CopyEngine(ABC):
    """Moves the bytes of whole chunks between a worker's KV tensors and its column.

    ``gpu_block_ids`` (``int64``, CPU) holds ``blocks_per_chunk`` block ids per chunk,
    in order; ``chunk_ids`` (``int64``, CPU) holds one slot per chunk. The worker has
    validated both. An engine never blocks its caller for longer than it takes to
    enqueue the copies (the CPU engine, which has nothing to enqueue on, copies).
    """

    layout: ColumnLayout

    def bind(self, layout: ColumnLayout) -> None:
        """Attach to a worker's tensors and column; called once, before any copy."""
        self.layout = layout

    @abstractmethod
    def store(self, gpu_block_ids: torch.Tensor, chunk_ids: torch.Tensor) -> CopyEvent:
        """Enqueue GPU blocks -> region slots."""

    @abstractmethod
    def load(self, chunk_ids: torch.Tensor, gpu_block_ids: torch.Tensor) -> CopyEvent:
        """Enqueue region slots -> GPU blocks."""

    def close(self) -> None:  # noqa: B027 - engines without resources need nothing here
        """Release engine resources; every event it returned is complete by then."""


def _chunk_runs(gpu_block_ids: torch.Tensor, blocks_per_chunk: int) -> list[tuple[int, list[int]]]:
    """Per chunk: its first GPU block when its blocks are consecutive (-1 if not), and all."""
    runs: list[tuple[int, list[int]]] = []
    ids = gpu_block_ids.tolist()
    for start in range(0, len(ids), blocks_per_chunk):
        chunk = ids[start : start + blocks_per_chunk]
        consecutive = chunk[-1] - chunk[0] == blocks_per_chunk - 1 and chunk == list(
            range(chunk[0], chunk[0] + blocks_per_chunk)
        )
        runs.append((chunk[0] if consecutive else -1, chunk))
    return runs


# CPU copies go chunk by chunk and tensor by tensor, each one a plain memory copy of a
# contiguous range: torch's index_copy_ walks byte by byte here and measured 1-1.5 GB/s
# against 5-6 GB/s for these copies (benchmarks/gpu_copy.py on the CPU).


def copy_store(layout: ColumnLayout, gpu_block_ids: torch.Tensor, chunk_ids: torch.Tensor) -> None:
    """GPU blocks -> slots, on CPU tensors."""
    bpc = layout.blocks_per_chunk
    runs = _chunk_runs(gpu_block_ids, bpc)
    slots = chunk_ids.tolist()
    for part in layout.slices:
        blocks, region = part.blocks, part.region_view
        for slot, (first, chunk) in zip(slots, runs, strict=True):
            if first >= 0:
                region[slot].copy_(blocks[first : first + bpc])
            else:
                torch.index_select(blocks, 0, torch.tensor(chunk), out=region[slot])


def copy_load(layout: ColumnLayout, chunk_ids: torch.Tensor, gpu_block_ids: torch.Tensor) -> None:
    """Slots -> GPU blocks, on CPU tensors."""
    bpc = layout.blocks_per_chunk
    runs = _chunk_runs(gpu_block_ids, bpc)
    slots = chunk_ids.tolist()
    for part in layout.slices:
        blocks, region = part.blocks, part.region_view
        for slot, (first, chunk) in zip(slots, runs, strict=True):
            if first >= 0:
                blocks[first : first + bpc].copy_(region[slot])
            else:
                for j, block in enumerate(chunk):
                    blocks[block].copy_(region[slot, j])


class CpuCopyEngine(CopyEngine):
    """Copies on the caller's thread; every event it returns is already complete."""

    def store(self, gpu_block_ids: torch.Tensor, chunk_ids: torch.Tensor) -> CopyEvent:
        copy_store(self.layout, gpu_block_ids, chunk_ids)
        return COMPLETED

    def load(self, chunk_ids: torch.Tensor, gpu_block_ids: torch.Tensor) -> CopyEvent:
        copy_load(self.layout, chunk_ids, gpu_block_ids)
        return COMPLETED


class _ThreadEvent(CopyEvent):
    def __init__(self, lane: str) -> None:
        self.lane = lane
        self._done = threading.Event()
        self.error: BaseException | None = None

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error

    def finish(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()


class ThreadedCopyEngine(CopyEngine):
    """Copies on one background thread per lane, like a GPU's copy streams.

    ``gate`` (set by default) must be set before a queued copy starts: a test clears it
    to hold copies in flight. ``delay_s`` sleeps before each copy. :meth:`fail_next`
    makes the next copies raise instead of copying.
    """

    def __init__(self, *, delay_s: float = 0.0, gate: threading.Event | None = None) -> None:
        self.delay_s = delay_s
        self.gate = gate if gate is not None else threading.Event()
        if gate is None:
            self.gate.set()
        self.copies_started = 0
        self._failures_left = 0
        self._lock = threading.Lock()
        self._queues: dict[
            str, queue.SimpleQueue[tuple[Callable[[], None], _ThreadEvent] | None]
        ] = {}
        self._threads: list[threading.Thread] = []

    def fail_next(self, count: int = 1) -> None:
        with self._lock:
            self._failures_left += count

    def store(self, gpu_block_ids: torch.Tensor, chunk_ids: torch.Tensor) -> CopyEvent:
        layout = self.layout
        return self._enqueue(STORE, lambda: copy_store(layout, gpu_block_ids, chunk_ids))

    def load(self, chunk_ids: torch.Tensor, gpu_block_ids: torch.Tensor) -> CopyEvent:
        layout = self.layout
        return self._enqueue(LOAD, lambda: copy_load(layout, chunk_ids, gpu_block_ids))

    def close(self) -> None:
        for lane_queue in self._queues.values():
            lane_queue.put(None)
        for thread in self._threads:
            thread.join()
        self._queues.clear()
        self._threads.clear()

    def _enqueue(self, lane: str, copy: Callable[[], None]) -> CopyEvent:
        lane_queue = self._queues.get(lane)
        if lane_queue is None:
            lane_queue = self._queues[lane] = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._run, args=(lane_queue,), name=f"kvtier-fake-{lane}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        event = _ThreadEvent(lane)
        lane_queue.put((copy, event))
        return event

    def _run(
        self, lane_queue: queue.SimpleQueue[tuple[Callable[[], None], _ThreadEvent] | None]
    ) -> None:
        while (item := lane_queue.get()) is not None:
            copy, event = item
            self.gate.wait()
            if self.delay_s:
                time.sleep(self.delay_s)
            with self._lock:
                self.copies_started += 1
                fail = self._failures_left > 0
                if fail:
                    self._failures_left -= 1
            try:
                if fail:
                    raise RuntimeError("injected copy failure")
                copy()
            except BaseException as exc:  # handed to whoever waits on the event
                event.finish(exc)
            else:
                event.finish(None)
