"""Rows that every rank works on: canonical pages the ranks scatter their heads into,
and the one copy of bytes that all ranks hold alike (replicated)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_config, wait_finished

from kvtier import ConfigError, OffloadingSpecFactory
from kvtier.config import storage_namespace
from kvtier.worker import PageMap, PageRun
from kvtier.worker.engines import gather_pages, scatter_pages

NUM_GPU_BLOCKS = 8
TOKENS = 4
HEADS = 4
HEAD_SIZE = 4  # float16: 8 bytes a head
HEAD_BYTES = 2 * HEAD_SIZE
#: Eight rows: each row is padded to a page.
CPU_BYTES = 8 * 8192


def full_kv(seed: int) -> torch.Tensor:
    """A layer's KV with every head: (blocks, K/V, tokens, heads, head size)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_GPU_BLOCKS, 2, TOKENS, HEADS, HEAD_SIZE)
    return torch.randn(shape, generator=gen).to(torch.float16)


def shard(kv: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s heads of ``kv`` under ``world``-way tensor parallelism."""
    heads = HEADS // world
    return kv[:, :, :, rank * heads : (rank + 1) * heads].contiguous()


def head_pages(rank: int, world: int) -> PageMap:
    """Where rank ``rank``'s token rows go in a page of all heads: K then V, each token's
    heads in rank order."""
    row = HEADS // world * HEAD_BYTES
    runs = tuple(
        PageRun(
            local_offset=half * TOKENS * row,
            shared_offset=half * TOKENS * world * row + rank * row,
            size=row,
            count=TOKENS,
            local_stride=row,
            shared_stride=world * row,
        )
        for half in range(2)
    )
    return PageMap(page_bytes=world * 2 * TOKENS * row, runs=runs)


def rank_specs(engine_id: str, world: int, per_block: int, **fields):
    """One spec per rank of a ``world``-rank engine, each holding ``per_block`` bytes."""
    return [
        OffloadingSpecFactory.create_spec(
            make_config(
                engine_id,
                kv_bytes_per_block=per_block,
                tokens_per_block=TOKENS,
                world_size=world,
                rank=rank,
                cpu_bytes_to_use=CPU_BYTES,
                **fields,
            )
        )
        for rank in range(world)
    ]


def canonical_specs(engine_id: str, world: int, **extra):
    """The ranks of an engine whose ``world`` ranks split the heads, canonically laid out."""
    per_block = 2 * TOKENS * HEADS // world * HEAD_BYTES
    return rank_specs(
        engine_id, world, per_block, layout="canonical", canonical_format="test-nhd", **extra
    )


def latent_ranks(engine_id: str, whole: int):
    """Two ranks holding the same ``whole``-byte pages (an MLA latent), canonically laid
    out in one copy per row."""
    return rank_specs(
        engine_id, 2, whole, layout="canonical", canonical_format="test-nhd", replicated=True
    )


def dealt_page(whole: int, rank: int) -> PageMap:
    """A whole page that two ranks hold alike, whose writing they take turns at."""
    run = PageRun(0, 0, whole, 1, whole, whole)
    return PageMap(page_bytes=whole, runs=(run,), writers=2, writer_index=rank)


def store(worker, job_id, blocks, slots):
    worker.submit_store(job_id, blocks, slots)
    [result] = wait_finished(worker, 1)
    assert result.success


def load(worker, job_id, slots, blocks):
    worker.submit_load(job_id, slots, blocks)
    [result] = wait_finished(worker, 1)
    assert result.success


def page_bytes(kv: torch.Tensor, blocks: list[int]) -> bytes:
    return b"".join(kv[block].numpy().tobytes() for block in blocks)


@pytest.mark.parametrize("block_size", [TOKENS, 2 * TOKENS])
def test_two_ranks_scatter_their_heads_into_the_page_one_rank_would_write(engine_id, block_size):
    # The page two ranks fill with half the heads each is byte for byte the one a
    # single rank holding every head writes: the bytes do not depend on the ranks.
    kv = full_kv(1)
    blocks = [5, 2] if block_size > TOKENS else [5]
    specs = canonical_specs(engine_id, 2, block_size=block_size)
    manager = specs[0].get_manager()
    shards = [shard(kv, r, 2) for r in range(2)]
    workers = [
        spec.create_worker([part], pages=[head_pages(r, 2)])
        for r, (spec, part) in enumerate(zip(specs, shards, strict=True))
    ]
    [alone] = canonical_specs(f"{engine_id}-one", 1, block_size=block_size)
    alone_manager = alone.get_manager()
    alone_worker = alone.create_worker([kv.clone()], pages=[head_pages(0, 1)])
    try:
        for worker in workers:
            store(worker, 1, blocks, [3])
        store(alone_worker, 1, blocks, [6])
        assert specs[0].geometry.chunk_bytes == alone.geometry.chunk_bytes
        assert storage_namespace(specs[0].config, specs[0].geometry) == storage_namespace(
            alone.config, alone.geometry
        )
        row = bytes(manager.region.primary_view[3])
        assert row == bytes(alone_manager.region.primary_view[6])
        assert row[: len(blocks) * kv[0].nbytes] == page_bytes(kv, blocks)

        # Each rank loads back its own heads, and only them.
        for r, (worker, part) in enumerate(zip(workers, shards, strict=True)):
            part.zero_()
            load(worker, 2, [3], [1, 7][: len(blocks)])
            for block, source in zip([1, 7], blocks, strict=False):
                assert torch.equal(part[block], shard(kv, r, 2)[source])
    finally:
        for spec in (*reversed(specs), alone):
            spec.shutdown()


def test_a_load_inside_a_chunk_reads_only_its_blocks_fragments(engine_id):
    kv = full_kv(2)
    specs = canonical_specs(engine_id, 2, block_size=2 * TOKENS)
    specs[0].get_manager()
    shards = [shard(kv, r, 2) for r in range(2)]
    workers = [
        spec.create_worker([part], pages=[head_pages(r, 2)])
        for r, (spec, part) in enumerate(zip(specs, shards, strict=True))
    ]
    try:
        for worker in workers:
            store(worker, 1, [0, 1, 2, 3], [4, 5])
        for r, (worker, part) in enumerate(zip(workers, shards, strict=True)):
            part.zero_()
            worker.submit_load(2, [4, 5], [6, 7], skip_blocks=1)
            assert all(result.success for result in wait_finished(worker, 1))
            expected = shard(kv, r, 2)
            assert torch.equal(part[6], expected[1]) and torch.equal(part[7], expected[2])
            assert not part[:6].any()
    finally:
        for spec in reversed(specs):
            spec.shutdown()


def test_ranks_that_hold_the_same_fragments_take_turns_writing_pages(engine_id):
    # Both ranks hold every head alike (an MLA latent): each writes the
    # pages it is dealt, so one rank's stores fill every other page, both fill all.
    kv = full_kv(3)
    whole = kv[0].nbytes
    specs = latent_ranks(engine_id, whole)
    manager = specs[0].get_manager()
    workers = [
        spec.create_worker([kv.clone()], pages=[dealt_page(whole, r)])
        for r, spec in enumerate(specs)
    ]
    try:
        store(workers[0], 1, [0, 1, 2, 3], [0, 1, 2, 3])
        rows = [bytes(manager.region.primary_view[slot])[:whole] for slot in range(4)]
        assert rows[0] == page_bytes(kv, [0]) and rows[2] == page_bytes(kv, [2])
        assert rows[1] == rows[3] == bytes(whole)
        store(workers[1], 1, [0, 1, 2, 3], [0, 1, 2, 3])
        for slot in range(4):
            assert bytes(manager.region.primary_view[slot])[:whole] == page_bytes(kv, [slot])
    finally:
        for spec in reversed(specs):
            spec.shutdown()


def test_a_replicated_row_holds_one_copy_written_by_rank_0_and_read_by_all(engine_id):
    kv = full_kv(4)
    per_block = kv[0].nbytes
    specs = rank_specs(engine_id, 2, per_block, replicated=True)
    manager = specs[0].get_manager()
    tensors = [kv.clone(), kv.clone()]
    workers = [spec.create_worker([tensors[r]]) for r, spec in enumerate(specs)]
    try:
        # One column a row, where two ranks would take two.
        assert specs[0].geometry.columns == 1
        assert specs[0].geometry.column_bytes == per_block
        store(workers[1], 1, [3], [0])
        assert not any(bytes(manager.region.primary_view[0]))
        store(workers[0], 1, [3], [0])
        assert bytes(manager.region.primary_view[0])[:per_block] == page_bytes(kv, [3])
        tensors[1].zero_()
        load(workers[1], 2, [0], [6])
        assert torch.equal(tensors[1][6], kv[3])
        namespace = storage_namespace(specs[0].config, specs[0].geometry)
        assert "replicated" in namespace and "world=" not in namespace
    finally:
        for spec in reversed(specs):
            spec.shutdown()


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"layout": "mirrored"}, "layout"),
        ({"layout": "canonical"}, "canonical_format"),
        ({"canonical_format": "v1-nhd"}, "canonical_format"),
    ],
)
def test_a_bad_layout_is_named(engine_id, fields, key):
    with pytest.raises(ConfigError, match=key):
        make_config(engine_id, **fields)


def test_a_worker_takes_page_maps_exactly_when_the_layout_is_canonical(engine_id):
    direct = OffloadingSpecFactory.create_spec(make_config(engine_id, kv_bytes_per_block=512))
    with pytest.raises(ValueError, match="page map"):
        direct.create_worker([full_kv(0)], pages=[head_pages(0, 1)])
    direct.shutdown()
    [canonical] = canonical_specs(f"{engine_id}-c", 1)
    with pytest.raises(ValueError, match="page map"):
        canonical.create_worker([full_kv(0)])
    too_far = PageMap(page_bytes=256, runs=(PageRun(0, 128, 256, 1, 256, 256),))
    with pytest.raises(ValueError, match="reaches past its 256-byte shared page"):
        canonical.create_worker([full_kv(0)], pages=[too_far])
    too_big = PageMap(page_bytes=512, runs=(PageRun(0, 0, 256, 1, 256, 256),))
    with pytest.raises(ValueError, match="512-byte shared pages do not fit"):
        canonical.create_worker([full_kv(0)], pages=[too_big])
    canonical.shutdown()


def test_fragments_through_a_bounce_buffer_land_where_the_workers_copies_put_them(engine_id):
    # A GPU rank copies its blocks to the host in one piece (a bounce buffer) and
    # scatters the fragments from there: the rows must be the very bytes its direct
    # copies write, and gathering them back must give the bounce buffer again.
    kv = full_kv(5)
    blocks = [5, 2]
    specs = canonical_specs(engine_id, 2, block_size=2 * TOKENS)
    manager = specs[0].get_manager()
    workers = [
        spec.create_worker([shard(kv, r, 2)], pages=[head_pages(r, 2)])
        for r, spec in enumerate(specs)
    ]
    try:
        bounces = []
        for worker in workers:
            store(worker, 1, blocks, [3])
            layout = worker.layout
            bounce = torch.cat([part.blocks[blocks] for part in layout.groups[0]], dim=1)
            assert bounce.shape[1] == layout.group_block_bytes[0]
            scatter_pages(layout, bounce, [4])
            bounces.append(bounce)
        assert bytes(manager.region.primary_view[4]) == bytes(manager.region.primary_view[3])
        for worker, bounce in zip(workers, bounces, strict=True):
            gathered = torch.zeros_like(bounce)
            gather_pages(worker.layout, [4], gathered)
            assert torch.equal(gathered, bounce)
    finally:
        for spec in reversed(specs):
            spec.shutdown()


def test_a_bounce_buffer_scatters_only_the_pages_its_rank_is_dealt(engine_id):
    kv = full_kv(6)
    whole = kv[0].nbytes
    specs = latent_ranks(engine_id, whole)
    manager = specs[0].get_manager()
    worker = specs[1].create_worker([kv.clone()], pages=[dealt_page(whole, 1)])
    try:
        blocks = [0, 1, 2, 3]
        scatter_pages(worker.layout, kv[blocks].view(4, -1).view(torch.uint8), [0, 1, 2, 3])
        rows = [bytes(manager.region.primary_view[slot])[:whole] for slot in range(4)]
        assert rows[1] == page_bytes(kv, [1]) and rows[3] == page_bytes(kv, [3])
        assert rows[0] == rows[2] == bytes(whole)
    finally:
        for spec in reversed(specs):
            spec.shutdown()


@pytest.mark.cuda
@pytest.mark.anyio
@pytest.mark.parametrize("gather", ["kernel", "torch"])
async def test_gpu_ranks_scatter_their_heads_into_canonical_pages(engine_id, monkeypatch, gather):
    # Two ranks, each with half the heads on the GPU, fill one canonical page through
    # their bounce buffers (gathered by the kernel, or forced, an operator per tensor);
    # each loads back exactly its heads.
    if gather == "torch":
        monkeypatch.setenv("KVTIER_CUDA_GATHER", "torch")
    from kvtier.worker.cuda import CudaCopyEngine

    kv = full_kv(7)
    specs = canonical_specs(engine_id, 2, block_size=2 * TOKENS)
    manager = specs[0].get_manager()
    shards = [shard(kv, r, 2).cuda() for r in range(2)]
    pages: list[PageMap] = [head_pages(r, 2) for r in range(2)]
    workers = [
        spec.create_worker([part], pages=[page])
        for spec, part, page in zip(specs, shards, pages, strict=True)
    ]
    try:
        for worker in workers:
            assert isinstance(worker.engine, CudaCopyEngine)
            assert worker.engine.gather_kernel == (gather == "kernel")
            assert (await worker.store([5, 2], [3])).success
        row = bytes(manager.region.primary_view[3])
        assert row[: 2 * kv[0].nbytes] == kv[5].numpy().tobytes() + kv[2].numpy().tobytes()
        for r, (worker, part) in enumerate(zip(workers, shards, strict=True)):
            part.zero_()
            assert (await worker.load([3], [1, 7])).success
            torch.cuda.synchronize()
            assert torch.equal(part[1].cpu(), shard(kv, r, 2)[5])
            assert torch.equal(part[7].cpu(), shard(kv, r, 2)[2])
    finally:
        for spec in reversed(specs):
            await spec.aclose()
