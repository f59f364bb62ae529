"""The KV tensor layouts a worker accepts: block index first, or vLLM's (2, num_blocks, ...)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import make_config

from kvtier import KVTier, OffloadingSpecFactory, prefix_keys
from kvtier.paged import PagedKVLayout
from kvtier.worker.gather import block_gather

LAYOUT = PagedKVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16)
BLOCKS = 24


def vllm_caches(seed: int = 0, heads: int = 2, blocks: int = BLOCKS) -> list[torch.Tensor]:
    """FlashAttention's per-layer layout: K and V stacked before the block index."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn((2, blocks, 16, heads, 8), generator=gen).to(torch.float16)
        for _ in range(LAYOUT.num_layers)
    ]


def config(engine_id: str):
    return LAYOUT.config(
        engine_id, cpu_tokens=256, tokens_per_chunk=32, model_name="m", kv_dtype="fp16"
    )


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16)


@pytest.mark.anyio
async def test_vllm_layout_stores_and_loads_back_byte_exact_through_kvtier(engine_id):
    caches = vllm_caches()
    keys = prefix_keys(range(96), 32, salt="m")  # 3 chunks of 2 blocks
    source, target = [7, 2, 3, 4, 11, 10], [12, 13, 14, 15, 16, 17]
    async with KVTier(config(engine_id), caches) as kv:
        assert await kv.store(keys, source, "w") == 3
        assert await kv.lookup(keys, "r") == 3
        assert await kv.load(keys, target, "r") == 3
        kv.finish("r")
    for layer in caches:
        assert torch.equal(as_bits(layer[:, source]), as_bits(layer[:, target]))
    untouched = vllm_caches()
    for layer, original in zip(caches, untouched, strict=True):
        others = [b for b in range(BLOCKS) if b not in target]
        assert torch.equal(as_bits(layer[:, others]), as_bits(original[:, others]))


@pytest.mark.anyio
async def test_a_vllm_layer_packs_its_k_blocks_then_its_v_blocks(engine_id):
    caches = vllm_caches()
    spec = OffloadingSpecFactory.create_spec(config(engine_id))
    manager = spec.get_manager()
    worker = spec.create_worker(caches)
    try:
        assert (await worker.store([5, 9], [3])).success
        row = bytes(manager.region.primary_view[3])
        expected = b"".join(
            layer[half, [5, 9]].numpy().tobytes() for layer in caches for half in (0, 1)
        )
        assert row[: len(expected)] == expected
    finally:
        await spec.aclose()


def test_block_first_tensors_are_still_read_as_they_are(engine_id):
    spec = OffloadingSpecFactory.create_spec(config(engine_id))
    try:
        worker = spec.create_worker(LAYOUT.allocate(BLOCKS))
        assert not worker.layout.split_kv
        assert worker.layout.num_gpu_blocks == BLOCKS
    finally:
        spec.shutdown()


@pytest.mark.parametrize(
    ("caches", "messages"),
    [
        pytest.param(
            vllm_caches(heads=3),
            [
                "kv_bytes_per_block=3072",
                "block index first, (num_blocks, ...)",
                "vLLM's per-layer (2, num_blocks, ...)",
                "split into K and V: the 6 tensors ((24, 16, 3, 8), ",
                "hold 4608 bytes per block (dimensions 1 onward), 3072 expected",
            ],
            id="vllm-layout-with-wrong-heads",
        ),
        pytest.param(
            [torch.zeros((24, 2, 16, 2, 8), dtype=torch.float16)] * 2
            + [torch.zeros((20, 2, 16, 2, 8), dtype=torch.float16)],
            [
                "kv_caches[2] (20, 2, 16, 2, 8) has 20 in dimension 0, the block index, "
                "where kv_caches[0] has 24",
                "kv_caches[0] (24, 2, 16, 2, 8) has 24, not 2 (K and V), in dimension 0",
            ],
            id="block-counts-disagree",
        ),
        pytest.param(
            [torch.zeros((2, 16, BLOCKS, 2, 8), dtype=torch.float16)] * 3,
            [
                "hold 36864 bytes per block (dimensions 1 onward), 3072 expected",
                "Dimension 2 (24) would fit as the block index: it must come first, or "
                "second after vLLM's 2",
            ],
            id="block-index-in-dimension-2",
        ),
    ],
)
def test_kv_caches_that_fit_no_layout_are_told_what_to_pass(engine_id, caches, messages):
    spec = OffloadingSpecFactory.create_spec(config(engine_id))
    try:
        with pytest.raises(ValueError) as caught:
            spec.create_worker(caches)
        for message in messages:
            assert message in str(caught.value)
    finally:
        spec.shutdown()


def test_a_vllm_layer_whose_blocks_are_not_contiguous_is_refused(engine_id):
    spec = OffloadingSpecFactory.create_spec(config(engine_id))
    strided = [torch.zeros((2, 16, BLOCKS, 2, 8), dtype=torch.float16).transpose(1, 2)] * 3
    try:
        with pytest.raises(ValueError, match=r"kv_caches\[0\]\[0\]: the bytes of one block"):
            spec.create_worker(strided)
    finally:
        spec.shutdown()


@pytest.mark.parametrize("packed", [False, True], ids=["columns", "packed"])
def test_the_operator_gather_lays_blocks_out_as_the_staging_row_says_and_back(engine_id, packed):
    # The CUDA engine's gather without its kernel (it runs on any device): a chunk's
    # blocks at each tensor's offset in the column, or one block of each tensor a row.
    generator = torch.Generator().manual_seed(5)
    tensors = [
        torch.randint(0, 256, (2, 16, size), dtype=torch.uint8, generator=generator)
        for size in (64, 32)
    ]
    spec = OffloadingSpecFactory.create_spec(
        make_config(engine_id, kv_bytes_per_block=2 * (64 + 32), block_size=32)
    )
    spec.get_manager()
    worker = spec.create_worker(tensors)
    try:
        layout = worker.layout
        parts = layout.groups[0]
        bpc = 1 if packed else layout.blocks_per_chunk
        width = layout.group_block_bytes[0] if packed else layout.column_bytes
        gather = block_gather(parts, width, torch.device("cpu"), packed=packed, kernel=False)
        assert not gather.kernel
        ids = torch.tensor([5, 2, 9, 7])
        staging = torch.zeros((len(ids) // bpc, width), dtype=torch.uint8)
        gather.gather(ids, staging, bpc)
        rows = [ids[i : i + bpc].tolist() for i in range(0, len(ids), bpc)]
        for row, blocks in zip(staging, rows, strict=True):
            expected = b"".join(
                part.blocks[block].numpy().tobytes() for part in parts for block in blocks
            )
            assert row.numpy().tobytes()[: len(expected)] == expected
        back = [tensor.clone() for tensor in tensors]
        for part in parts:
            part.blocks[[0, 1, 3, 4]] = 0
        gather.scatter(staging, torch.tensor([0, 1, 3, 4]), bpc)
        for tensor, original in zip(tensors, back, strict=True):
            assert torch.equal(tensor[:, [0, 1, 3, 4]], original[:, [5, 2, 9, 7]])
    finally:
        asyncio.run(worker.aclose())
        asyncio.run(spec.aclose())
