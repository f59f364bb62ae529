"""One kernel launch per job for the CUDA engine's gathers and scatters.

A store gathers a job's GPU blocks of every KV tensor of a group into the staging
buffer laid out like the region's columns; a load scatters them back. Done with torch
operators, that is one or two kernel launches per KV tensor (128 for a 64-tensor
model), and issuing them takes longer than the DMA they feed. Here one Triton kernel
moves every tensor's blocks at once: it reads a table of the tensors' addresses, and
copies 8-byte words instead of bytes.

The kernel's table is built once, when the engine binds to the KV tensors (their
memory is fixed for the worker's life). It applies where every tensor's rows, row
stride and offset in the staging row are whole words and Triton is installed (it is
wherever vLLM or SGLang run on a GPU); elsewhere :class:`OperatorGather` copies tensor
by tensor. :func:`block_gather` chooses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.worker.layout import TensorSlice

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine copies tensor by tensor
    HAVE_TRITON = False
else:
    HAVE_TRITON = True

__all__ = ["HAVE_TRITON", "KernelGather", "OperatorGather", "block_gather"]

#: Bytes each kernel thread moves at a time.
WORD = 8
#: Words one program copies of one block (16 KiB): larger blocks take several programs.
_PIECE = 2048


def block_gather(
    parts: Sequence[TensorSlice],
    width: int,
    device: torch.device,
    *,
    packed: bool = False,
    kernel: bool = True,
) -> KernelGather | OperatorGather:
    """How a group's blocks move between its KV tensors and a staging buffer whose rows
    are ``width`` bytes: one kernel where ``kernel`` allows it and it applies, else one
    operator per tensor.

    A staging row holds, per tensor, a chunk's blocks at the tensor's offset in the
    region's column, or, ``packed``, one block of each tensor back to back (a canonical
    layout's bounce buffer, whose rows are blocks).
    """
    offsets = [part.offset for part in parts]
    if packed:
        offsets = [sum(part.block_bytes for part in parts[:i]) for i in range(len(parts))]
    if kernel and HAVE_TRITON and _whole_words(parts, offsets, width):
        return KernelGather(parts, offsets, device)
    return OperatorGather(parts, offsets)


def _whole_words(parts: Sequence[TensorSlice], offsets: Sequence[int], width: int) -> bool:
    return width % WORD == 0 and all(
        part.blocks.stride(1) == 1
        and part.blocks.data_ptr() % WORD == 0
        and part.blocks.stride(0) % WORD == 0
        and part.block_bytes % WORD == 0
        and offset % WORD == 0
        for part, offset in zip(parts, offsets, strict=True)
    )


class OperatorGather:
    """One torch operator per KV tensor and direction: where the kernel does not apply."""

    kernel = False

    def __init__(self, parts: Sequence[TensorSlice], offsets: Sequence[int]) -> None:
        self._parts = list(zip(parts, offsets, strict=True))

    def gather(self, ids: torch.Tensor, staging: torch.Tensor, blocks_per_chunk: int) -> None:
        """Copy the blocks ``ids`` names (on the device, a chunk's blocks in order) into
        ``staging``, one row per chunk, each tensor's blocks at its offset."""
        rows = staging.shape[0]
        for part, offset in self._parts:
            span = part.block_bytes * blocks_per_chunk
            gathered = part.blocks.index_select(0, ids).view(rows, span)
            staging[:, offset : offset + span].copy_(gathered)

    def scatter(self, staging: torch.Tensor, ids: torch.Tensor, blocks_per_chunk: int) -> None:
        """The reverse of :meth:`gather`: ``staging``'s rows into the blocks ``ids``."""
        rows = staging.shape[0]
        for part, offset in self._parts:
            span = part.block_bytes * blocks_per_chunk
            blocks = staging[:, offset : offset + span].reshape(
                rows * blocks_per_chunk, part.block_bytes
            )
            part.blocks.index_copy_(0, ids, blocks)


class KernelGather:
    """One Triton kernel per job and direction, from a table of the tensors' addresses
    and geometry on the device."""

    kernel = True

    def __init__(
        self, parts: Sequence[TensorSlice], offsets: Sequence[int], device: torch.device
    ) -> None:
        def column(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self._parts = len(parts)
        self._addresses = column([part.blocks.data_ptr() for part in parts])
        self._row_words = column([part.blocks.stride(0) // WORD for part in parts])
        self._offsets = column([offset // WORD for offset in offsets])
        self._block_words = column([part.block_bytes // WORD for part in parts])
        self._pieces = -(-max(part.block_bytes // WORD for part in parts) // _PIECE)
        # The tensors must outlive the table that points into them.
        self._keep = [part.blocks for part in parts]

    def gather(self, ids: torch.Tensor, staging: torch.Tensor, blocks_per_chunk: int) -> None:
        """As :meth:`OperatorGather.gather`, in one launch."""
        self._launch(ids, staging, blocks_per_chunk, to_staging=True)

    def scatter(self, staging: torch.Tensor, ids: torch.Tensor, blocks_per_chunk: int) -> None:
        """As :meth:`OperatorGather.scatter`, in one launch."""
        self._launch(ids, staging, blocks_per_chunk, to_staging=False)

    def _launch(
        self, ids: torch.Tensor, staging: torch.Tensor, blocks_per_chunk: int, *, to_staging: bool
    ) -> None:
        words = staging.view(torch.int64)
        grid = (self._parts, ids.numel(), self._pieces)
        # Triton launches on the current device: the tensors' own, whatever the caller's.
        with torch.cuda.device(words.device):
            _copy_blocks[grid](
                self._addresses,
                self._row_words,
                self._offsets,
                self._block_words,
                ids,
                words,
                words.shape[1],
                blocks_per_chunk,
                PIECE=_PIECE,
                TO_STAGING=to_staging,
            )


if HAVE_TRITON:

    @triton.jit  # type: ignore[untyped-decorator]
    def _copy_blocks(  # type: ignore[no-untyped-def]
        addresses,
        row_words,
        offsets,
        block_words,
        ids,
        staging,
        column_words,
        blocks_per_chunk,
        PIECE: tl.constexpr,
        TO_STAGING: tl.constexpr,
    ):
        # Program (tensor, block of the job, piece of the block): PIECE words of one
        # block between the tensor and the block's place in its chunk's staging row.
        part = tl.program_id(0)
        row = tl.program_id(1)
        words = tl.load(block_words + part)
        cols = tl.program_id(2) * PIECE + tl.arange(0, PIECE)
        mask = cols < words
        block = tl.load(ids + row).to(tl.int64)
        tensor = tl.load(addresses + part).to(tl.pointer_type(tl.int64))
        tensor += block * tl.load(row_words + part) + cols
        chunk = row // blocks_per_chunk
        within = row - chunk * blocks_per_chunk
        place = staging + chunk.to(tl.int64) * column_words + tl.load(offsets + part)
        place += within * words + cols
        if TO_STAGING:
            tl.store(place, tl.load(tensor, mask=mask), mask=mask)
        else:
            tl.store(tensor, tl.load(place, mask=mask), mask=mask)
