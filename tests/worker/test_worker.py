"""GPU <-> primary copies through the worker, on CPU tensors and a threaded engine."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from helpers import make_config, wait_finished

from kvtier import OffloadingSpecFactory, SharedOffloadRegion
from kvtier.errors import KVTierError
from kvtier.specs.cpu import CPUOffloadingSpec
from kvtier.worker import GroupSplit, ThreadedCopyEngine

NUM_GPU_BLOCKS = 32


def kv_tensors(seed: int = 0) -> list[torch.Tensor]:
    """Two layers of different dtypes: 3072 + 1024 = 4096 bytes per block."""
    gen = torch.Generator().manual_seed(seed)
    layer0 = torch.randint(
        -(2**15), 2**15, (NUM_GPU_BLOCKS, 2, 768), dtype=torch.int16, generator=gen
    )
    layer1 = torch.rand((NUM_GPU_BLOCKS, 256), generator=gen).to(torch.float32)
    return [layer0, layer1]


def build(engine_id: str, engine=None, **extra):
    spec = OffloadingSpecFactory.create_spec(
        make_config(engine_id, kv_bytes_per_block=4096, **extra)
    )
    assert isinstance(spec, CPUOffloadingSpec)
    kv = kv_tensors()
    worker = spec.create_worker(kv, engine=engine)
    return spec, worker, kv


@pytest.fixture
def gate():
    event = threading.Event()
    yield event
    event.set()


@pytest.mark.anyio
async def test_store_then_load_round_trips_every_tensor(engine_id):
    spec, worker, kv = build(engine_id, block_size=32)
    try:
        stored = await worker.store([4, 5, 9, 1], [3, 0])
        assert stored.success and stored.transfer_bytes == 2 * 2 * 4096
        loaded = await worker.load([0, 3], [20, 21, 22, 23])
        assert loaded.success
        for tensor in kv:
            assert torch.equal(tensor[[9, 1, 4, 5]], tensor[[20, 21, 22, 23]])
    finally:
        await spec.aclose()


def test_a_chunk_packs_tensor_after_tensor_in_the_column(engine_id):
    spec, worker, kv = build(engine_id, block_size=32)
    manager = spec.get_manager()
    try:
        worker.submit_store(1, [6, 7], [2])
        [result] = wait_finished(worker, 1)
        assert result.job_id == 1 and result.success
        row = bytes(manager.region.primary_view[2])
        layer0, layer1 = (t.numpy().tobytes() for t in (kv[0][6:8], kv[1][6:8]))
        assert row[: len(layer0)] == layer0
        assert row[len(layer0) : len(layer0) + len(layer1)] == layer1
    finally:
        spec.shutdown()


@pytest.mark.parametrize(
    ("gpu_ids", "chunk_ids", "message"),
    [
        ([1], [0], "need 2 gpu_block_ids"),
        ([1, 2], [99], r"chunk_ids must lie in \[0, "),
        ([1, NUM_GPU_BLOCKS], [0], r"gpu_block_ids must lie in \[0, 32\)"),
        ([1, 2, 3, 4], [5, 5], "must not repeat"),
        ([[1, 2]], [0], "one-dimensional"),
        (["a", "b"], [0], "sequence of integers"),
    ],
)
def test_bad_ids_are_rejected_before_anything_is_copied(engine_id, gpu_ids, chunk_ids, message):
    spec, worker, _ = build(engine_id, block_size=32)
    try:
        with pytest.raises(ValueError, match=message):
            worker.submit_store(1, gpu_ids, chunk_ids)
        assert worker.get_finished() == []
    finally:
        spec.shutdown()


def test_a_load_must_not_write_one_gpu_block_twice(engine_id):
    spec, worker, _ = build(engine_id)
    try:
        with pytest.raises(ValueError, match="gpu_block_ids of a load must not repeat"):
            worker.submit_load(1, [0, 1], [4, 4])
    finally:
        spec.shutdown()


def test_kv_tensors_must_match_kv_bytes_per_block(engine_id):
    spec = OffloadingSpecFactory.create_spec(make_config(engine_id, kv_bytes_per_block=8192))
    with pytest.raises(ValueError, match=r"kv_bytes_per_block=8192.*hold 4096 bytes per block"):
        spec.create_worker(kv_tensors())
    spec.shutdown()


def test_kv_tensors_must_have_contiguous_blocks(engine_id):
    spec = OffloadingSpecFactory.create_spec(make_config(engine_id, kv_bytes_per_block=4096))
    transposed = torch.zeros((512, NUM_GPU_BLOCKS), dtype=torch.int64).t()
    with pytest.raises(ValueError, match="contiguous"):
        spec.create_worker([transposed])
    spec.shutdown()


def test_sync_jobs_finish_through_the_waiter(engine_id, gate):
    engine = ThreadedCopyEngine(gate=gate)
    spec, worker, kv = build(engine_id, engine=engine)
    try:
        worker.submit_store(7, [3], [1])
        worker.submit_store(8, [4], [2])
        assert worker.get_finished() == []
        assert worker.inflight == 2
        gate.set()
        results = wait_finished(worker, 2)
        assert [(r.job_id, r.success) for r in results] == [(7, True), (8, True)]
        # Loads run on their own lane: the host issues them once the store completed.
        worker.submit_load(9, [1], [30])
        [loaded] = wait_finished(worker, 1)
        assert loaded.job_id == 9 and loaded.success
        assert torch.equal(kv[0][3], kv[0][30])
    finally:
        spec.shutdown()


@pytest.mark.anyio
async def test_awaiting_a_copy_does_not_block_the_loop(engine_id, gate):
    engine = ThreadedCopyEngine(gate=gate)
    spec, worker, _ = build(engine_id, engine=engine)
    try:
        task = asyncio.ensure_future(worker.store([2], [0]))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not task.done()
        gate.set()
        result = await asyncio.wait_for(task, 30)
        assert result.success
    finally:
        await asyncio.to_thread(spec.shutdown)


@pytest.mark.anyio
async def test_cancelling_the_waiter_never_cancels_or_tears_the_copy(engine_id, gate):
    engine = ThreadedCopyEngine(gate=gate)
    spec, worker, kv = build(engine_id, engine=engine)
    manager = spec.get_manager()
    try:
        task = asyncio.ensure_future(worker.store([5], [4]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert worker.inflight == 1
        gate.set()
        await worker.aclose()
        assert worker.inflight == 0
        assert engine.copies_started == 1
        assert bytes(manager.region.primary_view[4][:3072]) == kv[0][5].numpy().tobytes()
    finally:
        await asyncio.to_thread(spec.shutdown)


def test_close_waits_for_copies_in_flight(engine_id, gate):
    engine = ThreadedCopyEngine(gate=gate)
    spec, worker, kv = build(engine_id, engine=engine)
    manager = spec.get_manager()
    worker.submit_store(1, [9], [2])
    closer = threading.Thread(target=worker.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive(), "close returned while a copy was still in flight"
    gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert bytes(manager.region.primary_view[2][:3072]) == kv[0][9].numpy().tobytes()
    with pytest.raises(KVTierError, match="closed"):
        worker.submit_store(2, [1], [1])
    spec.shutdown()


@pytest.mark.anyio
async def test_a_failed_copy_is_reported_not_raised(engine_id):
    engine = ThreadedCopyEngine()
    engine.fail_next()
    spec, worker, _ = build(engine_id, engine=engine)
    try:
        result = await worker.store([1], [1])
        assert not result.success
        assert (await worker.store([1], [1])).success
    finally:
        await asyncio.to_thread(spec.shutdown)


def test_two_ranks_fill_one_row_together(engine_id):
    config0 = make_config(engine_id, kv_bytes_per_block=4096, world_size=2, rank=0)
    config1 = make_config(engine_id, kv_bytes_per_block=4096, world_size=2, rank=1)
    spec0 = OffloadingSpecFactory.create_spec(config0)
    spec1 = OffloadingSpecFactory.create_spec(config1)
    manager = spec0.get_manager()
    kv0, kv1 = kv_tensors(0), kv_tensors(1)
    worker0 = spec0.create_worker(kv0)
    worker1 = spec1.create_worker(kv1)
    try:
        worker0.submit_store(1, [4], [7])
        worker1.submit_store(1, [4], [7])
        assert [r.success for r in wait_finished(worker0, 1) + wait_finished(worker1, 1)] == [
            True,
            True,
        ]
        row = bytes(manager.region.primary_view[7])
        assert row[:3072] == kv0[0][4].numpy().tobytes()
        assert row[4096 : 4096 + 3072] == kv1[0][4].numpy().tobytes()
    finally:
        spec1.shutdown()
        spec0.shutdown()


def test_worker_rejects_kv_tensors_on_an_unsupported_device(engine_id):
    spec = OffloadingSpecFactory.create_spec(make_config(engine_id, kv_bytes_per_block=4096))
    meta = torch.empty((NUM_GPU_BLOCKS, 1024), dtype=torch.float32, device="meta")
    with pytest.raises(ValueError, match="no copy engine"):
        spec.create_worker([meta])
    spec.shutdown()


def test_region_side_for_a_worker_has_no_scheduler_views(engine_id):
    with (
        SharedOffloadRegion(
            engine_id, num_chunks=2, chunk_bytes=4096, column_bytes=4096, world_size=1, rank=0
        ) as region,
        pytest.raises(KVTierError, match="scheduler side"),
    ):
        _ = region.primary_view


@pytest.mark.anyio
async def test_a_load_may_start_and_end_inside_a_chunk(engine_id):
    # Chunks of 4 blocks; the load skips the first chunk's first 3 blocks and ends
    # after the third chunk's first block: 1 + 4 + 1 blocks.
    spec, worker, kv = build(engine_id, block_size=64)
    try:
        assert (await worker.store(list(range(12)), [5, 2, 7])).success
        before = [tensor.clone() for tensor in kv]
        loaded = await worker.load([5, 2, 7], [20, 21, 22, 23, 24, 25], skip_blocks=3)
        assert loaded.success and loaded.transfer_bytes == 6 * 4096
        for tensor, old in zip(kv, before, strict=True):
            assert torch.equal(tensor[20:26], old[3:9])
            # Blocks outside the load are untouched.
            assert torch.equal(tensor[26:], old[26:]) and torch.equal(tensor[:20], old[:20])
    finally:
        await spec.aclose()


@pytest.mark.anyio
async def test_a_store_inside_one_chunk_writes_only_its_blocks(engine_id):
    spec, worker, kv = build(engine_id, block_size=64)
    manager = spec.get_manager()
    try:
        assert (await worker.store([0, 1, 2, 3], [1])).success
        row_before = bytes(manager.region.primary_view[1])
        assert (await worker.store([9, 10], [1], skip_blocks=1)).success
        await worker.load([1], [20, 21, 22, 23])
        for tensor in kv:
            assert torch.equal(tensor[[20, 21, 22, 23]], tensor[[0, 9, 10, 3]])
        assert bytes(manager.region.primary_view[1]) != row_before
    finally:
        await spec.aclose()


@pytest.mark.parametrize(
    ("gpu_ids", "chunk_ids", "skip", "message"),
    [
        ([1, 2], [0], 4, r"skip_blocks must lie in \[0, 4\)"),
        ([1, 2], [0, 1], 1, "span 1 chunk"),
        ([1, 2, 3, 4], [0], 1, "span 2 chunk"),
    ],
)
def test_a_partial_copy_must_name_the_chunks_it_spans(engine_id, gpu_ids, chunk_ids, skip, message):
    spec, worker, _ = build(engine_id, block_size=64)
    try:
        with pytest.raises(ValueError, match=message):
            worker.submit_load(1, chunk_ids, gpu_ids, skip_blocks=skip)
    finally:
        spec.shutdown()


def test_wait_returns_once_the_named_jobs_completed(engine_id, gate):
    spec, worker, _kv = build(engine_id, engine=ThreadedCopyEngine(gate=gate), block_size=32)
    try:
        worker.submit_store(7, [0, 1], [0])
        assert not worker.wait({7}, timeout=0.05)
        gate.set()
        assert worker.wait({7}, timeout=10)
        [result] = worker.get_finished()
        assert result.job_id == 7 and result.success
    finally:
        spec.shutdown()


def grouped_tensors(seed: int = 0) -> list[torch.Tensor]:
    """Three tensors of 1024, 1024 and 1536 bytes per block: 512 of the 4096 spare."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (NUM_GPU_BLOCKS, size), dtype=torch.uint8, generator=gen)
        for size in (1024, 1024, 1536)
    ]


def build_grouped(engine_id: str, **extra):
    """Two KV-cache groups sharing tensor 0, as a hybrid model's groups overlay each
    other: group 0 uses tensors 0 and 1, group 1 tensors 0 and 2."""
    spec = OffloadingSpecFactory.create_spec(
        make_config(engine_id, kv_bytes_per_block=4096, **extra)
    )
    kv = grouped_tensors()
    worker = spec.create_worker(kv, groups=[[0, 1], [0, 2]])
    return spec, worker, kv


def test_a_job_of_two_groups_copies_each_through_its_own_tensors(engine_id):
    spec, worker, kv = build_grouped(engine_id, block_size=32)
    manager = spec.get_manager()
    try:
        # Group 0's chunk (blocks 4, 5) to slot 3, group 1's (blocks 9, 1) to slot 0.
        split = GroupSplit(sizes=(2, 2), skips=(0, 0))
        worker.submit_store(1, [4, 5, 9, 1], [3, 0], groups=split)
        [stored] = wait_finished(worker, 1)
        assert stored.success and stored.transfer_bytes == 2 * 2048 + 2 * 2560
        group0_row = bytes(manager.region.primary_view[3])
        group1_row = bytes(manager.region.primary_view[0])
        # Each tensor's part of the column holds 2 blocks: 2048, 2048, then 3072 bytes.
        assert group0_row[:2048] == kv[0][4:6].numpy().tobytes()
        assert group0_row[2048:4096] == kv[1][4:6].numpy().tobytes()
        assert group0_row[4096:] == bytes(len(group0_row) - 4096)  # not group 0's
        assert group1_row[:2048] == kv[0][[9, 1]].numpy().tobytes()
        assert group1_row[2048:4096] == bytes(2048)  # not group 1's
        assert group1_row[4096:7168] == kv[2][[9, 1]].numpy().tobytes()

        before = [tensor.clone() for tensor in kv]
        worker.submit_load(2, [3, 0], [20, 21, 22, 23], groups=split)
        [loaded] = wait_finished(worker, 1)
        assert loaded.success and loaded.transfer_bytes == stored.transfer_bytes
        assert torch.equal(kv[0][20:22], before[0][4:6])
        assert torch.equal(kv[1][20:22], before[1][4:6])
        assert torch.equal(kv[2][20:22], before[2][20:22])  # group 0 never writes it
        assert torch.equal(kv[0][22:24], before[0][[9, 1]])
        assert torch.equal(kv[2][22:24], before[2][[9, 1]])
        assert torch.equal(kv[1][22:24], before[1][22:24])  # group 1 never writes it
    finally:
        spec.shutdown()


@pytest.mark.anyio
async def test_a_group_may_start_and_end_inside_its_chunks(engine_id):
    # Chunks of 4 blocks. Group 0 stores and loads the first 2 blocks of one chunk;
    # group 1 loads from 3 blocks into its first chunk to 1 block into its third.
    spec, worker, kv = build_grouped(engine_id, block_size=64)
    try:
        stored = await worker.store(
            [0, 1, *range(8, 20)], [6, 5, 2, 7], groups=GroupSplit(sizes=(2, 12), skips=(0, 0))
        )
        assert stored.success
        before = [tensor.clone() for tensor in kv]
        loaded = await worker.load(
            [6, 5, 2, 7],
            [20, 21, 24, 25, 26, 27, 28, 29],
            groups=GroupSplit(sizes=(2, 6), skips=(0, 3)),
        )
        assert loaded.success and loaded.transfer_bytes == 2 * 2048 + 6 * 2560
        assert torch.equal(kv[0][20:22], before[0][0:2])
        assert torch.equal(kv[1][20:22], before[1][0:2])
        assert torch.equal(kv[0][24:30], before[0][11:17])
        assert torch.equal(kv[2][24:30], before[2][11:17])
        for tensor, old in zip(kv, before, strict=True):
            assert torch.equal(tensor[22:24], old[22:24]) and torch.equal(tensor[30:], old[30:])
    finally:
        await spec.aclose()


@pytest.mark.parametrize(
    ("gpu_ids", "chunk_ids", "split", "message"),
    [
        ([1, 2], [0], None, "form 2 KV-cache groups"),
        ([1, 2], [0], GroupSplit((2,), (0,)), "names 1 group sizes"),
        ([1, 2], [0], GroupSplit((1, 0), (0, 0)), "add up to 1 blocks"),
        ([1, 2], [0], GroupSplit((1, 1), (0, 0)), "span 2 chunk"),
        ([1, 2], [0, 1, 2], GroupSplit((2, 0), (1, 0)), "but 3 chunk_ids"),
        ([1], [0], GroupSplit((0, 1), (0, 2)), r"skip must lie in \[0, 2\)"),
        ([1, 1], [0, 1], GroupSplit((1, 1), (0, 0)), "gpu_block_ids of a load must not repeat"),
    ],
)
def test_a_grouped_copy_must_name_each_groups_blocks_and_chunks(
    engine_id, gpu_ids, chunk_ids, split, message
):
    spec, worker, _ = build_grouped(engine_id, block_size=32)
    try:
        with pytest.raises(ValueError, match=message):
            worker.submit_load(1, chunk_ids, gpu_ids, groups=split)
    finally:
        spec.shutdown()


def test_groups_must_name_tensors_that_exist(engine_id):
    spec = OffloadingSpecFactory.create_spec(make_config(engine_id, kv_bytes_per_block=4096))
    try:
        with pytest.raises(ValueError, match=r"groups\[1\] names kv_caches\[3\]"):
            spec.create_worker(grouped_tensors(), groups=[[0], [3]])
        # Without groups the tensors must fill the column's 4096 bytes per block.
        with pytest.raises(ValueError, match="hold 3584 bytes per block"):
            spec.create_worker(grouped_tensors())
    finally:
        spec.shutdown()
