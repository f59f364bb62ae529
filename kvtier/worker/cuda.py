"""GPU <-> primary copies on dedicated CUDA streams.

A store job gathers its GPU blocks into one device staging buffer laid out exactly like
the destination columns (one kernel for every KV tensor), then moves it to the region
with one device-to-host copy per slot (one per run of adjacent slots when the columns
of adjacent rows touch). A load does the reverse. Per-job cost is therefore one kernel
launch plus one DMA per slot, instead of one DMA per tensor per block, and each DMA is
a whole column: the size at which PCIe runs at full speed.

The region is registered with the driver as pinned host memory so the DMAs are truly
asynchronous; if registration fails (a locked-memory limit, an old driver) copies still
work from pageable memory, more slowly, and a warning says so once.

The gather or scatter is one Triton kernel per job where it applies
(:mod:`kvtier.worker.gather`), else one or two torch operators per KV tensor, whose
issuing costs more CPU time than the DMA takes; ``KVTIER_CUDA_GATHER=torch`` in the
environment chooses the operators always (to compare the two).

A canonical layout's rank writes fragments of pages other ranks write too, so its
bytes cannot reach the region in whole-column DMAs. A store gathers the job's blocks on
the GPU as for a column, copies them in one DMA to a pinned bounce buffer, and a host
thread then scatters the fragments into the shared pages; a load gathers them on that
thread into a bounce buffer, then moves it to the GPU in one DMA. The host thread
(one per direction, like the streams) keeps the caller from ever waiting for either.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from kvtier.region import SharedOffloadRegion
from kvtier.worker.engines import (
    LOAD,
    STORE,
    CopyEngine,
    CopyEvent,
    CpuCopyEngine,
    gather_pages,
    scatter_pages,
)
from kvtier.worker.gather import KernelGather, OperatorGather, block_gather
from kvtier.worker.layout import ColumnLayout

__all__ = ["CudaCopyEngine"]

logger = logging.getLogger(__name__)


class _CudaEvent(CopyEvent):
    __slots__ = ("_event", "_keepalive", "lane")

    def __init__(self, lane: str, stream: torch.cuda.Stream, keepalive: tuple[Any, ...]) -> None:
        self.lane = lane
        # blocking=True: a waiter thread sleeps in synchronize() instead of spinning.
        self._event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        self._event.record(stream)
        # Staging buffers and index tensors must outlive the copies that use them.
        self._keepalive: tuple[Any, ...] | None = keepalive

    def query(self) -> bool:
        done = bool(self._event.query())  # type: ignore[no-untyped-call]
        if done:
            self._keepalive = None
        return done

    def synchronize(self) -> None:
        self._event.synchronize()
        self._keepalive = None


class CudaCopyEngine(CopyEngine):
    """Copies on two dedicated streams, one per direction, ending each job with an event."""

    def __init__(self, region: SharedOffloadRegion, *, register_host_memory: bool = True) -> None:
        self._region = region
        self._register = register_host_memory
        self._registered_address: int | None = None

    def bind(self, layout: ColumnLayout) -> None:
        super().bind(layout)
        device = layout.device
        if device.type != "cuda":
            raise ValueError(f"CudaCopyEngine needs KV tensors on a CUDA device, got {device}")
        self._device = device
        #: The host side of a canonical layout's copies (None: whole columns).
        self._host: CpuCopyEngine | None = None
        if layout.canonical:
            self._host = CpuCopyEngine()
            self._host.bind(layout)
        self._store_stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._load_stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        # Adjacent rows' columns touch only when a row is exactly one column wide.
        self._rows_adjacent = layout.column.stride(0) == layout.column_bytes
        #: Per group, how blocks move to and from staging (a canonical layout's are its
        #: bounce buffers: a block of each tensor a row).
        widths = layout.group_block_bytes if layout.canonical else None
        kernel = os.environ.get("KVTIER_CUDA_GATHER") != "torch"
        self._gathers: list[KernelGather | OperatorGather] = [
            block_gather(
                parts,
                layout.column_bytes if widths is None else widths[group],
                device,
                packed=layout.canonical,
                kernel=kernel,
            )
            for group, parts in enumerate(layout.groups)
        ]
        if self._register:
            self._pin_region()

    @property
    def gather_kernel(self) -> bool:
        """Whether every group's copies gather and scatter with one kernel per job."""
        return all(gather.kernel for gather in self._gathers)

    def store(
        self, gpu_block_ids: torch.Tensor, chunk_ids: torch.Tensor, group: int = 0
    ) -> CopyEvent:
        if self._host is not None:
            return self._store_pages(gpu_block_ids, chunk_ids, group)
        layout = self.layout
        n = chunk_ids.numel()
        bpc = layout.blocks_per_chunk
        parts = layout.groups[group]
        # KV bytes are written by the compute stream: copy only what it has finished.
        producer = torch.cuda.current_stream(self._device)
        stream = self._store_stream
        with torch.cuda.stream(stream):
            stream.wait_stream(producer)
            ids = gpu_block_ids.to(self._device, non_blocking=True)
            # A group that leaves part of the column to other groups' tensors writes
            # zeros there, not whatever the allocator's block held before.
            new = torch.empty if len(parts) == len(layout.slices) else torch.zeros
            staging = new((n, layout.column_bytes), dtype=torch.uint8, device=self._device)
            self._gathers[group].gather(ids, staging, bpc)
            for first, count, slot in self._runs(chunk_ids):
                layout.column[slot : slot + count].copy_(
                    staging[first : first + count], non_blocking=True
                )
            return _CudaEvent(STORE, stream, (staging, ids, gpu_block_ids, chunk_ids))

    def load(
        self, chunk_ids: torch.Tensor, gpu_block_ids: torch.Tensor, group: int = 0
    ) -> CopyEvent:
        if self._host is not None:
            return self._load_pages(chunk_ids, gpu_block_ids, group)
        layout = self.layout
        n = chunk_ids.numel()
        bpc = layout.blocks_per_chunk
        consumer = torch.cuda.current_stream(self._device)
        stream = self._load_stream
        with torch.cuda.stream(stream):
            # The target blocks may still be read by earlier work on the compute stream.
            stream.wait_stream(consumer)
            ids = gpu_block_ids.to(self._device, non_blocking=True)
            staging = torch.empty((n, layout.column_bytes), dtype=torch.uint8, device=self._device)
            for first, count, slot in self._runs(chunk_ids):
                staging[first : first + count].copy_(
                    layout.column[slot : slot + count], non_blocking=True
                )
            self._gathers[group].scatter(staging, ids, bpc)
            return _CudaEvent(LOAD, stream, (staging, ids, gpu_block_ids, chunk_ids))

    def _store_pages(
        self, gpu_block_ids: torch.Tensor, chunk_ids: torch.Tensor, group: int
    ) -> CopyEvent:
        """A canonical layout's store: gather on the GPU, one DMA to a pinned bounce
        buffer, then the host thread scatters the fragments once the DMA is done."""
        assert self._host is not None
        layout = self.layout
        producer = torch.cuda.current_stream(self._device)
        stream = self._store_stream
        rows = gpu_block_ids.numel()
        bounce = torch.empty(
            (rows, layout.group_block_bytes[group]), dtype=torch.uint8, pin_memory=True
        )
        with torch.cuda.stream(stream):
            stream.wait_stream(producer)
            ids = gpu_block_ids.to(self._device, non_blocking=True)
            staging = torch.empty(bounce.shape, dtype=torch.uint8, device=self._device)
            self._gathers[group].gather(ids, staging, 1)
            bounce.copy_(staging, non_blocking=True)
            copied = _CudaEvent(STORE, stream, (staging, ids, gpu_block_ids))
        slots: list[int] = chunk_ids.tolist()

        def scatter() -> None:
            copied.synchronize()
            scatter_pages(layout, bounce, slots, group)

        return self._host.run_on_lane(STORE, scatter)

    def _load_pages(
        self, chunk_ids: torch.Tensor, gpu_block_ids: torch.Tensor, group: int
    ) -> CopyEvent:
        """A canonical layout's load: the host thread gathers the fragments into a
        pinned bounce buffer, then moves it to the GPU in one DMA and waits for it."""
        assert self._host is not None
        layout = self.layout
        # The target blocks may still be read by work already on the compute stream:
        # mark where it stands now, for the load stream to wait on later.
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(self._device))
        stream = self._load_stream
        device = self._device
        rows = gpu_block_ids.numel()
        slots: list[int] = chunk_ids.tolist()

        def gather_and_copy() -> None:
            bounce = torch.empty(
                (rows, layout.group_block_bytes[group]), dtype=torch.uint8, pin_memory=True
            )
            gather_pages(layout, slots, bounce, group)
            with torch.cuda.device(device), torch.cuda.stream(stream):
                stream.wait_event(ready)
                ids = gpu_block_ids.to(device, non_blocking=True)
                staging = bounce.to(device, non_blocking=True)
                self._gathers[group].scatter(staging, ids, 1)
                done = _CudaEvent(LOAD, stream, (staging, ids, bounce))
            done.synchronize()

        return self._host.run_on_lane(LOAD, gather_and_copy)

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
        for stream in (getattr(self, "_store_stream", None), getattr(self, "_load_stream", None)):
            if stream is not None:
                stream.synchronize()
        if self._registered_address is not None:
            rc = _cudart().cudaHostUnregister(self._registered_address)
            if _code(rc) != 0:
                logger.warning("cudaHostUnregister of the region failed (error %s)", _code(rc))
            self._registered_address = None

    def _runs(self, chunk_ids: torch.Tensor) -> list[tuple[int, int, int]]:
        """``(first job index, count, first slot)`` of each run of adjacent slots."""
        slots = chunk_ids.tolist()
        runs: list[tuple[int, int, int]] = []
        for i, slot in enumerate(slots):
            if runs and self._rows_adjacent:
                first, count, start = runs[-1]
                if start + count == slot:
                    runs[-1] = (first, count + 1, start)
                    continue
            runs.append((i, 1, slot))
        return runs

    def _pin_region(self) -> None:
        address, length = self._region.mapping_address()
        # cudaHostRegisterDefault: the mapping is shared by other processes, each of
        # which registers its own view; portable/mapped flags would buy nothing here.
        rc = _cudart().cudaHostRegister(address, length, 0)
        if _code(rc) == 0:
            self._registered_address = address
        else:
            logger.warning(
                "could not pin the primary region for the GPU (cudaHostRegister error %s); "
                "copies fall back to pageable memory and will be slower",
                _code(rc),
            )


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _code(rc: object) -> int:
    value: Any = getattr(rc, "value", rc)
    return int(value)
