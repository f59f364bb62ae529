"""How a worker's KV tensors pack into its column of the primary region.

Each KV tensor (a layer, a K or V half, a KV-cache group: whatever the host passes)
has the GPU block index as its first dimension. A chunk is ``blocks_per_chunk``
consecutive GPU blocks of one request. Inside the rank's column of a slot the tensors
follow one another in the order the host passed them, each holding its
``blocks_per_chunk`` blocks back to back::

    | tensor 0: block 0 .. block b-1 | tensor 1: block 0 .. block b-1 | ... |

so one tensor's part of a chunk is one contiguous byte range of the column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ColumnLayout", "TensorSlice"]


@dataclass(frozen=True)
class TensorSlice:
    """One KV tensor and where its bytes go in the column."""

    #: The KV tensor as ``uint8`` rows, one per GPU block: ``(num_gpu_blocks, block_bytes)``.
    blocks: torch.Tensor
    block_bytes: int
    #: Byte offset of this tensor's part inside the column.
    offset: int
    #: That part of every slot: ``(num_chunks, blocks_per_chunk, block_bytes)``, a view of
    #: the region.
    region_view: torch.Tensor


class ColumnLayout:
    """The KV tensors of one worker matched against its region column.

    Raises:
        ValueError: the tensors disagree on the number of blocks, a block is not one
            contiguous run of bytes, or the tensors' bytes per block do not add up to
            the column's ``column_bytes / blocks_per_chunk``.
    """

    def __init__(
        self, kv_caches: Sequence[torch.Tensor], column: torch.Tensor, blocks_per_chunk: int
    ) -> None:
        if not kv_caches:
            raise ValueError("kv_caches is empty: a worker needs at least one KV tensor")
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        self.column = column
        self.num_chunks, self.column_bytes = column.shape
        self.blocks_per_chunk = blocks_per_chunk
        num_blocks = kv_caches[0].shape[0]
        device = kv_caches[0].device
        all_blocks: list[torch.Tensor] = []
        for i, tensor in enumerate(kv_caches):
            if tensor.dim() < 1 or tensor.shape[0] != num_blocks:
                raise ValueError(
                    f"kv_caches[{i}] has shape {tuple(tensor.shape)}; every KV tensor must "
                    f"have the GPU block index first, with {num_blocks} blocks"
                )
            if tensor.device != device:
                raise ValueError(f"kv_caches[{i}] is on {tensor.device}, kv_caches[0] on {device}")
            all_blocks.append(_as_block_bytes(tensor, i))
        per_block = sum(blocks.shape[1] for blocks in all_blocks)
        if per_block * blocks_per_chunk != self.column_bytes:
            raise ValueError(
                f"the KV tensors hold {per_block} bytes per GPU block, but the region's "
                f"column holds {self.column_bytes // blocks_per_chunk} (kv_bytes_per_block): "
                "pass every KV tensor of this worker, or fix kv_bytes_per_block"
            )
        slices: list[TensorSlice] = []
        offset = 0
        for blocks in all_blocks:
            block_bytes = blocks.shape[1]
            span = block_bytes * blocks_per_chunk
            region_view = column[:, offset : offset + span].view(
                self.num_chunks, blocks_per_chunk, block_bytes
            )
            slices.append(TensorSlice(blocks, block_bytes, offset, region_view))
            offset += span
        self.slices = tuple(slices)
        self.num_gpu_blocks = num_blocks
        self.device = device


def _as_block_bytes(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """View ``tensor`` as ``uint8`` rows of one block each, without copying."""
    if tensor.shape[0] == 0:
        raise ValueError(f"kv_caches[{index}] has no blocks")
    block = tensor[0]
    if not block.is_contiguous():
        raise ValueError(
            f"kv_caches[{index}]: the bytes of one block must be contiguous "
            f"(shape {tuple(tensor.shape)}, strides {tensor.stride()})"
        )
    per_block = block.numel()
    stride = tensor.stride(0) if tensor.dim() > 1 else 1
    if tensor.dim() == 1:
        rows = tensor.view(-1, 1)
    else:
        rows = torch.as_strided(tensor, (tensor.shape[0], per_block), (stride, 1))
    return rows.view(torch.uint8)
