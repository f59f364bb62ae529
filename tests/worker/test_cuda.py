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
@pytest.mark.parametrize("gather", ["kernel", "torch"])
async def test_gpu_tensors_of_several_sizes_fill_rows_as_the_cpu_engine_does(
    engine_id, monkeypatch, gather
):
    # Three (K, V) layers of three sizes, two blocks a chunk: the gather kernel (or,
    # forced, one operator per tensor) writes every row byte for byte as the CPU engine
    # writes it, and a load puts every block back.
    if gather == "torch":
        monkeypatch.setenv("KVTIER_CUDA_GATHER", "torch")
    generator = torch.Generator().manual_seed(3)
    shapes = [(2, 64, 1024), (2, 64, 2048), (2, 64, 512)]
    tensors = [torch.randint(0, 256, s, dtype=torch.uint8, generator=generator) for s in shapes]
    rows = {}
    for device in ("cpu", "cuda"):
        config = make_config(
            f"{engine_id}-{device}", kv_bytes_per_block=2 * (1024 + 2048 + 512), block_size=32
        )
        spec = OffloadingSpecFactory.create_spec(config)
        manager = spec.get_manager()
        kv = [tensor.to(device) for tensor in tensors]
        worker = spec.create_worker(kv)
        try:
            if device == "cuda":
                assert isinstance(worker.engine, CudaCopyEngine)
                assert worker.engine.gather_kernel == (gather == "kernel")
            assert (await worker.store([9, 4, 60, 1], [3, 7])).success
            rows[device] = [bytes(manager.region.primary_view[slot]) for slot in (3, 7)]
            assert (await worker.load([3, 7], [20, 21, 22, 23])).success
            if device == "cuda":
                torch.cuda.synchronize()
            for tensor in kv:
                blocks = tensor.transpose(0, 1)  # (K, V) first: block index first
                assert torch.equal(blocks[20:24].cpu(), blocks[[9, 4, 60, 1]].cpu())
        finally:
            await worker.aclose()
            await spec.aclose()
    assert rows["cuda"] == rows["cpu"]
