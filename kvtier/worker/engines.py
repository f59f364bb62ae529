"""Copy engines: what actually moves bytes between KV tensors and the region.

An engine enqueues the copies of one job and returns a :class:`CopyEvent` that says
when they are done. The worker owns everything around it (argument checks, timing,
waiting, results), so an engine is only the copies.

- :class:`CpuCopyEngine` copies CPU tensors (the stand-in for a GPU when CUDA is
  absent) on one background thread per direction, so the caller, often an event loop,
  never waits for the bytes.
- :class:`ThreadedCopyEngine` is the CPU engine with copies that a test can hold back
  with a gate, slow down or make fail, so the waiting, cancellation and shutdown paths
  of the worker run in tests exactly as they do with a GPU.
- :class:`~kvtier.worker.cuda.CudaCopyEngine` enqueues on dedicated CUDA streams.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.resources import BlockingResource
from kvtier.worker.layout import ColumnLayout, TensorSlice, page_run_views

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


class CopyEngine(BlockingResource):
    """Moves the bytes of whole chunks between a worker's KV tensors and its column.

    ``gpu_block_ids`` (``int64``, CPU) holds ``blocks_per_chunk`` block ids per chunk,
    in order; ``chunk_ids`` (``int64``, CPU) holds one slot per chunk. The worker has
    validated both. ``group`` is the KV-cache group the chunks belong to: only its
    tensors (``layout.groups[group]``) are copied. An engine never blocks its caller
    for longer than it takes to enqueue the copies: the caller may be an event loop.
    An engine that copies at once anyway returns :data:`COMPLETED`.
    """

    layout: ColumnLayout

    def bind(self, layout: ColumnLayout) -> None:
        """Attach to a worker's tensors and column; called once, before any copy."""
        self.layout = layout

    @abstractmethod
    def store(
        self, gpu_block_ids: torch.Tensor, chunk_ids: torch.Tensor, group: int = 0
    ) -> CopyEvent:
        """Enqueue GPU blocks -> region slots."""

    @abstractmethod
    def load(
        self, chunk_ids: torch.Tensor, gpu_block_ids: torch.Tensor, group: int = 0
    ) -> CopyEvent:
        """Enqueue region slots -> GPU blocks."""

    def close(self) -> None:
        """Release engine resources; every event it returned is complete by then."""


@dataclass(frozen=True)
class _Run:
    """``count`` chunks in adjacent slots from ``slot`` whose blocks are adjacent too,
    from ``first`` on; or one chunk (``first`` -1) whose blocks are scattered."""

    slot: int
    first: int
    count: int
    blocks: list[int]


def _runs(gpu_block_ids: torch.Tensor, chunk_ids: torch.Tensor, bpc: int) -> list[_Run]:
    ids, slots = gpu_block_ids.tolist(), chunk_ids.tolist()
    runs: list[_Run] = []
    for index, slot in enumerate(slots):
        chunk = ids[index * bpc : (index + 1) * bpc]
        if chunk != list(range(chunk[0], chunk[0] + bpc)):
            runs.append(_Run(slot, -1, 1, chunk))
            continue
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.first >= 0
            and (slot == last.slot + last.count and chunk[0] == last.first + last.count * bpc)
        ):
            runs[-1] = _Run(last.slot, last.first, last.count + 1, [])
        else:
            runs.append(_Run(slot, chunk[0], 1, []))
    return runs


# CPU copies go tensor by tensor and run by run, each one a plain (strided) memory copy:
# torch's index_copy_ walks byte by byte here and measured 1-1.5 GB/s against 5-6 GB/s
# for these copies (benchmarks/gpu_copy.py on the CPU). Merging adjacent chunks into one
# copy matters off the loop's thread too: torch lets go of the GIL only inside a copy,
# and the event loop gets it back reliably only during copies long enough for its
# thread to wake (else it waits out the 5 ms switch interval).


def copy_store(
    layout: ColumnLayout, gpu_block_ids: torch.Tensor, chunk_ids: torch.Tensor, group: int = 0
) -> None:
    """GPU blocks -> slots, on CPU tensors."""
    bpc = layout.blocks_per_chunk
    runs = _runs(gpu_block_ids, chunk_ids, bpc)
    for part in layout.groups[group]:
        if not part.writes_all():
            _copy_dealt_pages(part, runs, bpc)
            continue
        for blocks, region in part.runs:
            for run in runs:
                if run.first >= 0:
                    source = blocks[run.first : run.first + run.count * bpc]
                    region[run.slot : run.slot + run.count].copy_(
                        source.view(run.count, bpc, *source.shape[1:])
                    )
                else:
                    torch.index_select(blocks, 0, torch.tensor(run.blocks), out=region[run.slot])


def _copy_dealt_pages(part: TensorSlice, runs: list[_Run], bpc: int) -> None:
    """Store the pages of a canonical layout this rank is dealt, one block at a time:
    the other ranks that hold the same fragments write the rest."""
    page = part.page
    assert page is not None
    for run in runs:
        for index in range(run.count * bpc):
            chunk, position = divmod(index, bpc)
            slot = run.slot + chunk
            if not page.writes(slot * bpc + position):
                continue
            block = run.first + index if run.first >= 0 else run.blocks[index]
            for blocks, region in part.runs:
                region[slot, position].copy_(blocks[block])


def copy_load(
    layout: ColumnLayout, chunk_ids: torch.Tensor, gpu_block_ids: torch.Tensor, group: int = 0
) -> None:
    """Slots -> GPU blocks, on CPU tensors."""
    bpc = layout.blocks_per_chunk
    runs = _runs(gpu_block_ids, chunk_ids, bpc)
    for part in layout.groups[group]:
        for blocks, region in part.runs:
            for run in runs:
                if run.first >= 0:
                    target = blocks[run.first : run.first + run.count * bpc]
                    target.view(run.count, bpc, *target.shape[1:]).copy_(
                        region[run.slot : run.slot + run.count]
                    )
                else:
                    for j, block in enumerate(run.blocks):
                        blocks[block].copy_(region[run.slot, j])


def scatter_pages(
    layout: ColumnLayout, bounce: torch.Tensor, slots: list[int], group: int = 0
) -> None:
    """Store a canonical layout's fragments from ``bounce`` into their slots.

    ``bounce`` (``uint8``, ``(len(slots) * blocks_per_chunk,
    layout.group_block_bytes[group])``) holds the job's blocks in order, each as the
    group's tensors' pages back to back: what a GPU gathers and copies to the host in
    one piece, since its fragments cannot land in the shared pages without a copy
    each. Only the pages this rank is dealt are written.
    """
    bpc = layout.blocks_per_chunk
    for part, pairs in _bounce_runs(layout, bounce, group):
        page = part.page
        assert page is not None
        for i, slot in enumerate(slots):
            if part.writes_all():  # each run of the chunk's blocks in one copy
                for source, region in pairs:
                    region[slot].copy_(source[i * bpc : (i + 1) * bpc])
                continue
            for j in range(bpc):
                if page.writes(slot * bpc + j):
                    for source, region in pairs:
                        region[slot, j].copy_(source[i * bpc + j])


def gather_pages(
    layout: ColumnLayout, slots: list[int], bounce: torch.Tensor, group: int = 0
) -> None:
    """Load a canonical layout's fragments of ``slots`` into ``bounce``, laid out as
    :func:`scatter_pages` reads it (the runs cover every byte of a page)."""
    bpc = layout.blocks_per_chunk
    for _, pairs in _bounce_runs(layout, bounce, group):
        for i, slot in enumerate(slots):
            for target, region in pairs:
                target[i * bpc : (i + 1) * bpc].copy_(region[slot])


def _bounce_runs(
    layout: ColumnLayout, bounce: torch.Tensor, group: int
) -> list[tuple[TensorSlice, tuple[tuple[torch.Tensor, torch.Tensor], ...]]]:
    """Each of the group's tensors, with its page runs as ``(bounce side, region side)``
    views, as :attr:`TensorSlice.runs` holds them for the KV tensor."""
    out = []
    offset = 0
    for part in layout.groups[group]:
        if part.page is None:
            raise ValueError("a bounce buffer carries a canonical layout's pages only")
        local = bounce[:, offset : offset + part.block_bytes]
        out.append((part, page_run_views(part.page, local, part.region_view, "bounce buffer")))
        offset += part.block_bytes
    return out


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


_Lane = queue.SimpleQueue[tuple[Callable[[], None], _ThreadEvent] | None]


class CpuCopyEngine(CopyEngine):
    """Copies CPU tensors on one background thread per lane (store, load).

    On the caller's thread these copies stalled an async host's event loop for their
    whole length (24-34 ms per 1.8k tokens of a 30-layer model here). One thread per
    lane, not a pool: a lane's jobs then complete in submission order, which the
    worker's waiter relies on, loads never queue behind stores, and more threads would
    not copy faster, since the copies are bound by memory bandwidth and would only take
    cores from the loop and the model. torch releases the GIL inside each copy, so the
    loop keeps running meanwhile. A job, once queued, always runs to its end: nothing
    cancels it half way, and :meth:`close` lets the queued ones finish first.
    """

    def __init__(self) -> None:
        self._lanes: dict[str, _Lane] = {}
        self._threads: list[threading.Thread] = []
        self._lanes_lock = threading.Lock()

    def store(
        self, gpu_block_ids: torch.Tensor, chunk_ids: torch.Tensor, group: int = 0
    ) -> CopyEvent:
        layout = self.layout
        return self._enqueue(STORE, lambda: copy_store(layout, gpu_block_ids, chunk_ids, group))

    def load(
        self, chunk_ids: torch.Tensor, gpu_block_ids: torch.Tensor, group: int = 0
    ) -> CopyEvent:
        layout = self.layout
        return self._enqueue(LOAD, lambda: copy_load(layout, chunk_ids, gpu_block_ids, group))

    def run_on_lane(self, lane: str, work: Callable[[], None]) -> CopyEvent:
        """Run ``work`` on the lane's thread after the jobs queued before it; the event
        completes when it returns (and raises what it raised)."""
        return self._enqueue(lane, work)

    def close(self) -> None:
        with self._lanes_lock:
            lanes, self._lanes = list(self._lanes.values()), {}
            threads, self._threads = self._threads, []
        for lane in lanes:
            lane.put(None)
        for thread in threads:
            thread.join()

    def bind(self, layout: ColumnLayout) -> None:
        super().bind(layout)
        # Started now, not at the first copy: a starting thread waits for the GIL,
        # which a copy thread already running holds for up to the switch interval.
        for name in (STORE, LOAD):
            self._lane(name)

    def before_copy(self) -> None:
        """Runs on the lane thread before each copy; raising fails that job."""

    def _lane(self, name: str) -> _Lane:
        with self._lanes_lock:
            lane = self._lanes.get(name)
            if lane is None:
                lane = self._lanes[name] = queue.SimpleQueue()
                thread = threading.Thread(
                    target=self._run, args=(lane,), name=f"kvtier-copy-{name}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
            return lane

    def _enqueue(self, name: str, copy: Callable[[], None]) -> CopyEvent:
        event = _ThreadEvent(name)
        self._lane(name).put((copy, event))
        return event

    def _run(self, lane: _Lane) -> None:
        while (item := lane.get()) is not None:
            copy, event = item
            try:
                self.before_copy()
                copy()
            except BaseException as exc:  # handed to whoever waits on the event
                event.finish(exc)
            else:
                event.finish(None)


class ThreadedCopyEngine(CpuCopyEngine):
    """The CPU engine with copies a test controls, like a GPU's copy streams.

    ``gate`` (set by default) must be set before a queued copy starts: a test clears it
    to hold copies in flight. ``delay_s`` sleeps before each copy. :meth:`fail_next`
    makes the next copies raise instead of copying.
    """

    def __init__(self, *, delay_s: float = 0.0, gate: threading.Event | None = None) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.gate = gate if gate is not None else threading.Event()
        if gate is None:
            self.gate.set()
        self.copies_started = 0
        self._failures_left = 0
        self._lock = threading.Lock()

    def fail_next(self, count: int = 1) -> None:
        with self._lock:
            self._failures_left += count

    def before_copy(self) -> None:
        self.gate.wait()
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._lock:
            self.copies_started += 1
            fail = self._failures_left > 0
            if fail:
                self._failures_left -= 1
        if fail:
            raise RuntimeError("injected copy failure")
