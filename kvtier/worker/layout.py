"""How a worker's KV tensors pack into its column of the primary region.

Each KV tensor (a layer, a K or V half, a KV-cache group: whatever the host passes)
has the GPU block index as its first dimension and each block's bytes contiguous. A
chunk is ``blocks_per_chunk`` GPU blocks of one request. Inside the rank's column of a
slot the tensors follow one another in the order the host passed them, each holding
its ``blocks_per_chunk`` blocks back to back::

    | tensor 0: block 0 .. block b-1 | tensor 1: block 0 .. block b-1 | ... |

so one tensor's part of a chunk is one contiguous byte range of the column.

A host whose model has several KV-cache groups (vLLM's hybrid models: full attention
beside sliding-window or Mamba layers) names, per group, the tensors its layers use. A
slot then holds one chunk of one group: only that group's tensors are copied into and
out of it, and the rest of the column is left alone. Such groups overlay each other in
one allocation, so their tensors may take fewer bytes per block than the column
offers (vLLM pads a block of the allocation); the spare bytes stay unused.

A canonical layout (:class:`~kvtier.config.OffloadingConfig`'s ``layout``) gives each
tensor a :class:`PageMap`: the column then holds, per tensor, pages laid out as if there
were no parallelism, and each rank copies its fragments (its heads of every token, say)
to their places in them. The runs of a page map are views of the same bytes on both
sides, so a copy moves fragments straight between the KV tensor and the region. Ranks
that hold the same fragments take turns writing them, page by page.

vLLM's FlashAttention layout, per-layer tensors shaped ``(2, num_blocks, ...)`` (K and
V stacked in front of the block index), is read as two tensors, the layer's K then its
V, each with the block index first. When the tensors read right both ways (two blocks
of two-block-first tensors), block index first wins.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ColumnLayout", "PageMap", "PageRun", "TensorSlice", "block_first_tensors"]


@dataclass(frozen=True)
class PageRun:
    """Fragments of this worker's page of a block and their places in the shared page:
    fragment ``i`` is ``size`` bytes at ``local_offset + i * local_stride`` of the
    worker's page and at ``shared_offset + i * shared_stride`` of the shared one."""

    local_offset: int
    shared_offset: int
    size: int
    count: int
    local_stride: int
    shared_stride: int


@dataclass(frozen=True)
class PageMap:
    """How one KV tensor's page of a block on this worker maps into the page that all
    workers share (``page_bytes`` per block). ``writers`` ranks hold these very
    fragments; of those, this one (``writer_index``) writes the pages whose id (slot
    times blocks per chunk, plus the block's place in its chunk) it is dealt.
    """

    page_bytes: int
    runs: tuple[PageRun, ...]
    writers: int = 1
    writer_index: int = 0

    def writes(self, page_id: int) -> bool:
        """Whether this rank writes shared page ``page_id``."""
        return page_id % self.writers == self.writer_index


@dataclass(frozen=True)
class TensorSlice:
    """One KV tensor and where its bytes go in the column."""

    #: The KV tensor as ``uint8`` rows, one per GPU block: ``(num_gpu_blocks, block_bytes)``.
    blocks: torch.Tensor
    block_bytes: int
    #: Byte offset of this tensor's part inside the column.
    offset: int
    #: That part of every slot: ``(num_chunks, blocks_per_chunk, page bytes)``, a view of
    #: the region.
    region_view: torch.Tensor
    #: What a copy moves, as ``(blocks side, region side)`` views of the same shape past
    #: their leading dimensions: the whole blocks and ``region_view``, or per page run
    #: ``(num_gpu_blocks, count, size)`` and ``(num_chunks, blocks_per_chunk, count, size)``.
    runs: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    #: The page map of a canonical layout (None: the worker's own pages, whole).
    page: PageMap | None = None

    def writes_all(self) -> bool:
        """Whether a store writes every page (no other rank shares the writing)."""
        return self.page is None or self.page.writers == 1


class ColumnLayout:
    """The KV tensors of one worker matched against its region column.

    ``groups`` lists, per KV-cache group, the indices into ``kv_caches`` of the tensors
    that group's layers use (None: one group of every tensor). With groups, the tensors
    may hold fewer bytes per block than the column offers.

    ``pages`` (a canonical layout) gives one :class:`PageMap` per entry of
    ``kv_caches``, which must then have the block index first: the column holds each
    tensor's shared pages, and copies move the fragments the runs name.

    Raises:
        ValueError: the tensors read neither block index first nor as vLLM's
            ``(2, num_blocks, ...)``, with as many blocks each and as many bytes per
            block together as the column's ``column_bytes / blocks_per_chunk`` (at
            most as many with groups or pages); a block is not one contiguous run of
            bytes; a group is empty or names a tensor that is not there; or the page
            maps do not fit the tensors or the column.
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        column: torch.Tensor,
        blocks_per_chunk: int,
        groups: Sequence[Sequence[int]] | None = None,
        pages: Sequence[PageMap] | None = None,
    ) -> None:
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        self.column = column
        self.num_chunks, self.column_bytes = column.shape
        self.blocks_per_chunk = blocks_per_chunk
        tensors = block_first_tensors(
            kv_caches,
            self.column_bytes // blocks_per_chunk,
            spare_bytes=groups is not None or pages is not None,
        )
        if pages is not None and len(pages) != len(tensors):
            raise ValueError(
                f"{len(pages)} page maps for {len(tensors)} KV tensors (with the block "
                "index first): give one per tensor"
            )
        num_blocks = tensors[0][1].shape[0]
        device = tensors[0][1].device
        all_blocks = [_as_block_bytes(tensor, name) for name, tensor in tensors]
        slices: list[TensorSlice] = []
        offset = 0
        for i, blocks in enumerate(all_blocks):
            block_bytes = blocks.shape[1]
            page = None if pages is None else pages[i]
            page_bytes = block_bytes if page is None else page.page_bytes
            span = page_bytes * blocks_per_chunk
            if offset + span > self.column_bytes:
                raise ValueError(
                    f"{tensors[i][0]}'s {page_bytes}-byte shared pages do not fit the "
                    f"column's {self.column_bytes // blocks_per_chunk} bytes per block "
                    f"after the {offset // blocks_per_chunk} the tensors before it take"
                )
            region_view = column[:, offset : offset + span].view(
                self.num_chunks, blocks_per_chunk, page_bytes
            )
            runs = (
                ((blocks, region_view),)
                if page is None
                else page_run_views(page, blocks, region_view, tensors[i][0])
            )
            slices.append(TensorSlice(blocks, block_bytes, offset, region_view, runs, page))
            offset += span
        self.slices = tuple(slices)
        #: Whether the column holds shared pages that each rank writes fragments of.
        self.canonical = pages is not None
        self.num_gpu_blocks = num_blocks
        self.device = device
        #: How the host's tensors were read: as they are, or split into K and V views.
        self.split_kv = len(tensors) != len(kv_caches)
        #: The slices each KV-cache group copies (one group of all slices by default).
        self.groups: tuple[tuple[TensorSlice, ...], ...] = (
            (self.slices,) if groups is None else self._group_slices(groups, len(kv_caches))
        )
        #: Bytes one GPU block of each group moves.
        self.group_block_bytes = tuple(
            sum(part.block_bytes for part in group) for group in self.groups
        )

    def _group_slices(
        self, groups: Sequence[Sequence[int]], num_caches: int
    ) -> tuple[tuple[TensorSlice, ...], ...]:
        """Each group's slices, from the indices of ``kv_caches`` its layers use."""
        if not groups:
            raise ValueError("groups is empty: name the KV tensors of at least one group")
        per_cache = 2 if self.split_kv else 1
        out: list[tuple[TensorSlice, ...]] = []
        for g, indices in enumerate(groups):
            if not indices:
                raise ValueError(f"groups[{g}] names no KV tensor")
            bad = [i for i in indices if not 0 <= i < num_caches]
            if bad:
                raise ValueError(
                    f"groups[{g}] names kv_caches[{bad[0]}], but there are {num_caches}"
                )
            # Layers of one group that share a tensor copy it once.
            unique = dict.fromkeys(indices)
            out.append(
                tuple(
                    self.slices[i * per_cache + half] for i in unique for half in range(per_cache)
                )
            )
        return tuple(out)


def page_run_views(
    page: PageMap, blocks: torch.Tensor, region_view: torch.Tensor, name: str
) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """The ``(blocks side, region side)`` views of each run of ``page``.

    Raises:
        ValueError: a run reaches past the tensor's block or the shared page.
    """
    block_bytes = blocks.shape[1]
    out = []
    for run in page.runs:
        if run.size < 1 or run.count < 1:
            raise ValueError(f"{name}: a page run moves no bytes ({run})")
        local_end = run.local_offset + (run.count - 1) * run.local_stride + run.size
        shared_end = run.shared_offset + (run.count - 1) * run.shared_stride + run.size
        if min(run.local_offset, run.shared_offset) < 0 or local_end > block_bytes:
            raise ValueError(f"{name}: a page run reaches past its {block_bytes}-byte block")
        if shared_end > page.page_bytes:
            raise ValueError(
                f"{name}: a page run reaches past its {page.page_bytes}-byte shared page"
            )
        local = blocks.as_strided(
            (blocks.shape[0], run.count, run.size),
            (blocks.stride(0), run.local_stride, 1),
            blocks.storage_offset() + run.local_offset,
        )
        shared = region_view.as_strided(
            (*region_view.shape[:2], run.count, run.size),
            (*region_view.stride()[:2], run.shared_stride, 1),
            region_view.storage_offset() + run.shared_offset,
        )
        out.append((local, shared))
    return tuple(out)


def block_first_tensors(
    kv_caches: Sequence[torch.Tensor], block_bytes: int, *, spare_bytes: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """``kv_caches`` as named tensors with the block index first, ``block_bytes`` per block
    (at most that many with ``spare_bytes``).

    Tensors with the block index first come back as they are (``kv_caches[i]``); vLLM's
    per-layer ``(2, num_blocks, ...)`` tensors come back as K and V views
    (``kv_caches[i][0]``, ``kv_caches[i][1]``).

    Raises:
        ValueError: neither reading fits; the message says what to pass, which
            dimension is off and the bytes per block expected against found.
    """
    if not kv_caches:
        raise ValueError("kv_caches is empty: a worker needs at least one KV tensor")
    for i, tensor in enumerate(kv_caches):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"kv_caches[{i}] is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.dim() < 1:
            raise ValueError(f"kv_caches[{i}] is a scalar; KV tensors have the block index first")
        if tensor.device != kv_caches[0].device:
            raise ValueError(
                f"kv_caches[{i}] is on {tensor.device}, kv_caches[0] on {kv_caches[0].device}"
            )
    as_given = [(f"kv_caches[{i}]", tensor) for i, tensor in enumerate(kv_caches)]
    given_misfit = _misfit(as_given, block_bytes, spare_bytes)
    if given_misfit is None:
        return as_given
    not_vllm = next(
        (
            f"kv_caches[{i}] {tuple(tensor.shape)} has {tensor.shape[0]}, not 2 (K and V), "
            "in dimension 0"
            for i, tensor in enumerate(kv_caches)
            if tensor.dim() < 2 or tensor.shape[0] != 2
        ),
        None,
    )
    if not_vllm is None:
        as_vllm = [
            (f"kv_caches[{i}][{half}]", view)
            for i, tensor in enumerate(kv_caches)
            for half, view in enumerate(tensor.unbind(0))
        ]
        vllm_misfit = _misfit(as_vllm, block_bytes, spare_bytes)
        if vllm_misfit is None:
            return as_vllm
        vllm = f"Read as vLLM's (2, num_blocks, ...), split into K and V: {vllm_misfit}"
    else:
        vllm = f"Nor is it vLLM's (2, num_blocks, ...): {not_vllm}."
    total = f"at most {block_bytes}" if spare_bytes else str(block_bytes)
    raise ValueError(
        f"kv_caches do not fit kv_bytes_per_block={block_bytes}. Pass tensors with the "
        "block index first, (num_blocks, ...), each block's bytes contiguous (as "
        "kvtier.paged.PagedKVLayout.allocate builds them), or vLLM's per-layer "
        "(2, num_blocks, ...) tensors; either way the same number of blocks in every "
        f"tensor and {total} bytes per block in all of them together. "
        f"Read block index first: {given_misfit} {vllm}"
        f"{_block_dim_hint(kv_caches, block_bytes)}"
    )


def _misfit(
    tensors: Sequence[tuple[str, torch.Tensor]], block_bytes: int, spare_bytes: bool
) -> str | None:
    """Why ``tensors`` are not block-first with ``block_bytes`` per block (at most that
    many with ``spare_bytes``); None if they are."""
    first_name, first = tensors[0]
    num_blocks = first.shape[0]
    for name, tensor in tensors:
        if tensor.shape[0] != num_blocks:
            return (
                f"{name} {tuple(tensor.shape)} has {tensor.shape[0]} in dimension 0, the "
                f"block index, where {first_name} has {num_blocks}."
            )
    found = sum(_bytes_per_block(tensor) for _, tensor in tensors)
    if found > block_bytes or (found != block_bytes and not spare_bytes):
        shapes = ", ".join(str(tuple(tensor.shape)) for _, tensor in tensors[:3])
        more = ", ..." if len(tensors) > 3 else ""
        expected = f"at most {block_bytes}" if spare_bytes else str(block_bytes)
        return (
            f"the {len(tensors)} tensors ({shapes}{more}) hold {found} bytes per block "
            f"(dimensions 1 onward), {expected} expected."
        )
    return None


def _block_dim_hint(kv_caches: Sequence[torch.Tensor], block_bytes: int) -> str:
    """Point at a later dimension that would fit as the block index, if one does."""
    first = kv_caches[0]
    total = sum(tensor.numel() * tensor.element_size() for tensor in kv_caches)
    for dim in range(1, first.dim()):
        count = first.shape[dim]
        if count < 2 or any(t.dim() <= dim or t.shape[dim] != count for t in kv_caches):
            continue
        if total == count * block_bytes:
            return (
                f" Dimension {dim} ({count}) would fit as the block index: it must come "
                "first, or second after vLLM's 2, with each block's bytes contiguous."
            )
    return ""


def _bytes_per_block(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def _as_block_bytes(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """View ``tensor`` as ``uint8`` rows of one block each, without copying."""
    if tensor.shape[0] == 0:
        raise ValueError(f"{name} has no blocks")
    block = tensor[0]
    if not block.is_contiguous():
        raise ValueError(
            f"{name}: the bytes of one block must be contiguous "
            f"(shape {tuple(tensor.shape)}, strides {tensor.stride()})"
        )
    per_block = block.numel()
    stride = tensor.stride(0) if tensor.dim() > 1 else 1
    if tensor.dim() == 1:
        rows = tensor.view(-1, 1)
    else:
        rows = torch.as_strided(tensor, (tensor.shape[0], per_block), (stride, 1))
    return rows.view(torch.uint8)
