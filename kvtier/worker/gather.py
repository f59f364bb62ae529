"""One kernel launch per job for the CUDA engine's gathers and scatters.

A store gathers a job's GPU blocks of every KV tensor of a group into the staging
buffer laid out like the region's columns; a load scatters them back. Done with torch
operators, that is one or two kernel launches per KV tensor (128 for a 64-tensor
model), and issuing them takes longer than the DMA they feed. Here one Triton kernel
moves every tensor's blocks at once: it reads a table of the tensors' addresses, and
copies 8-byte words instead of bytes.

The table is built once, when the engine binds to the KV tensors (their memory is
fixed for the worker's life). It applies where every tensor's rows, row stride and
offset in the column are whole words and Triton is installed (it is wherever vLLM or
SGLang run on a GPU); elsewhere the engine copies tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtier.worker.layout import TensorSlice

try:
    import triton
    import triton.language as tl
except ImportError:  # the engine copies tensor by tensor
    HAVE_TRITON = False
else:
    HAVE_TRITON = True

__all__ = ["HAVE_TRITON", "GroupTable"]

#: Bytes each kernel thread moves at a time.
WORD = 8
#: Words one program copies of one block (16 KiB): larger blocks take several programs.
_PIECE = 2048


class GroupTable:
    """The addresses and geometry of one KV-cache group's tensors, on the device."""

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

    @staticmethod
    def build(
        parts: Sequence[TensorSlice],
        column_bytes: int,
        device: torch.device,
        *,
        packed: bool = False,
    ) -> GroupTable | None:
        """A table for ``parts``, or None where the kernel does not apply.

        A staging row is ``column_bytes`` wide and holds each tensor's blocks at its
        offset in the region's column, or, ``packed``, one block of each tensor back to
        back (a canonical layout's bounce buffer, whose rows are blocks).
        """
        offsets = [part.offset for part in parts]
        if packed:
            offsets = [sum(part.block_bytes for part in parts[:i]) for i in range(len(parts))]
        if not HAVE_TRITON or column_bytes % WORD:
            return None
        for part, offset in zip(parts, offsets, strict=True):
            blocks = part.blocks
            if (
                blocks.stride(1) != 1
                or blocks.data_ptr() % WORD
                or blocks.stride(0) % WORD
                or part.block_bytes % WORD
                or offset % WORD
            ):
                return None
        return GroupTable(parts, offsets, device)

    def gather(self, ids: torch.Tensor, staging: torch.Tensor, blocks_per_chunk: int) -> None:
        """Copy the blocks ``ids`` names (on the device, a chunk's blocks in order) into
        ``staging``, ``(chunks, column_bytes)`` bytes, at each tensor's offset."""
        self._launch(_gather, ids, staging, blocks_per_chunk)

    def scatter(self, staging: torch.Tensor, ids: torch.Tensor, blocks_per_chunk: int) -> None:
        """The reverse of :meth:`gather`: ``staging``'s columns into the blocks ``ids``."""
        self._launch(_scatter, ids, staging, blocks_per_chunk)

    def _launch(
        self, kernel: Any, ids: torch.Tensor, staging: torch.Tensor, blocks_per_chunk: int
    ) -> None:
        words = staging.view(torch.int64)
        grid = (self._parts, ids.numel(), self._pieces)
        # Triton launches on the current device: the tensors' own, whatever the caller's.
        with torch.cuda.device(words.device):
            kernel[grid](
                self._addresses,
                self._row_words,
                self._offsets,
                self._block_words,
                ids,
                words,
                words.shape[1],
                blocks_per_chunk,
                PIECE=_PIECE,
            )


if HAVE_TRITON:

    @triton.jit  # type: ignore[untyped-decorator]
    def _gather(  # type: ignore[no-untyped-def]
        addresses,
        row_words,
        offsets,
        block_words,
        ids,
        staging,
        column_words,
        blocks_per_chunk,
        PIECE: tl.constexpr,
    ):
        part = tl.program_id(0)
        row = tl.program_id(1)
        words = tl.load(block_words + part)
        cols = tl.program_id(2) * PIECE + tl.arange(0, PIECE)
        mask = cols < words
        block = tl.load(ids + row).to(tl.int64)
        source = tl.load(addresses + part).to(tl.pointer_type(tl.int64))
        source += block * tl.load(row_words + part) + cols
        chunk = row // blocks_per_chunk
        within = row - chunk * blocks_per_chunk
        target = staging + chunk.to(tl.int64) * column_words + tl.load(offsets + part)
        target += within * words + cols
        tl.store(target, tl.load(source, mask=mask), mask=mask)

    @triton.jit  # type: ignore[untyped-decorator]
    def _scatter(  # type: ignore[no-untyped-def]
        addresses,
        row_words,
        offsets,
        block_words,
        ids,
        staging,
        column_words,
        blocks_per_chunk,
        PIECE: tl.constexpr,
    ):
        part = tl.program_id(0)
        row = tl.program_id(1)
        words = tl.load(block_words + part)
        cols = tl.program_id(2) * PIECE + tl.arange(0, PIECE)
        mask = cols < words
        block = tl.load(ids + row).to(tl.int64)
        target = tl.load(addresses + part).to(tl.pointer_type(tl.int64))
        target += block * tl.load(row_words + part) + cols
        chunk = row // blocks_per_chunk
        within = row - chunk * blocks_per_chunk
        source = staging + chunk.to(tl.int64) * column_words + tl.load(offsets + part)
        source += within * words + cols
        tl.store(target, tl.load(source, mask=mask), mask=mask)
