"""GPU copies through the CUDA engine; skipped where CUDA is absent."""

from __future__ import annotations

import pytest
import torch
from helpers import make_config

from kvtier import OffloadingSpecFactory
from kvtier.worker.cuda import CudaCopyEngine

pytestmark = pytest.mark.cuda


@pytest.mark.anyio
async def test_gpu_round_trip_through_the_region(engine_id):
    spec = OffloadingSpecFactory.create_spec(
        make_config(engine_id, kv_bytes_per_block=8192, block_size=32)
    )
    kv = [torch.randint(0, 255, (64, 4096), dtype=torch.uint8, device="cuda") for _ in range(2)]
    worker = spec.create_worker(kv)
    assert isinstance(worker.engine, CudaCopyEngine)
    try:
        assert (await worker.store([1, 2, 7, 3], [5, 0])).success
        assert (await worker.load([0, 5], [40, 41, 42, 43])).success
        torch.cuda.synchronize()
        for tensor in kv:
            assert torch.equal(tensor[[7, 3, 1, 2]], tensor[40:44])
    finally:
        await worker.aclose()
        await spec.aclose()


@pytest.mark.anyio
async def test_gpu_ranks_scatter_their_heads_into_canonical_pages(engine_id):
    # Two ranks, each with half the heads on the GPU, fill one canonical page through
    # their bounce buffers; each loads back exactly its heads.
    from test_shared_layouts import TOKENS, canonical_specs, full_kv, head_pages, shard

    from kvtier.worker import PageMap

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
