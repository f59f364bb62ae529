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
