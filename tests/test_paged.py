"""PagedKVLayout: a block pool's geometry turned into kv_caches, config and sizing."""

from __future__ import annotations

import mmap

import pytest
import torch

from kvtier import KVTier, OffloadingSpecFactory, prefix_keys
from kvtier.paged import PagedKVLayout

# SmolLM2-135M's geometry per worker: 30 layers, 3 KV heads of 64.
SMOL = PagedKVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float32)
SMALL = PagedKVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


def fill(caches, seed):
    gen = torch.Generator().manual_seed(seed)
    for layer in caches:
        layer.copy_(torch.randn(layer.shape, generator=gen).to(layer.dtype))


def test_kv_bytes_per_block_counts_k_and_v_of_every_layer():
    assert SMOL.kv_bytes_per_token == 46_080
    assert SMOL.kv_bytes_per_block == 46_080 * 16
    assert SMALL.kv_bytes_per_block == 3 * 2 * 16 * 2 * 8 * 2


def test_allocate_puts_the_block_index_first_with_each_block_contiguous():
    caches = SMALL.allocate(5)
    assert len(caches) == 3
    for layer in caches:
        assert layer.shape == (5, 2, 16, 2, 8)
        assert layer.dtype == torch.bfloat16 and layer.device.type == "cpu"
        assert layer[3].is_contiguous()
        assert not layer.any()
    assert sum(layer[0].numel() * layer.element_size() for layer in caches) == (
        SMALL.kv_bytes_per_block
    )


@pytest.mark.parametrize(
    ("layout", "accepted"),
    [(SMALL, True), (PagedKVLayout(3, 2, 8, torch.float32), False)],  # twice the bytes
)
def test_the_worker_accepts_what_allocate_builds_for_kv_bytes_per_block(
    engine_id, layout, accepted
):
    config = SMALL.config(
        engine_id, cpu_tokens=64, tokens_per_chunk=32, model_name="m", kv_dtype="bf16"
    )
    spec = OffloadingSpecFactory.create_spec(config)
    try:
        if accepted:
            assert spec.create_worker(layout.allocate(8)).blocks_per_chunk == 2
        else:
            with pytest.raises(ValueError, match="kv_bytes_per_block"):
                spec.create_worker(layout.allocate(8))
    finally:
        spec.shutdown()


@pytest.mark.anyio
async def test_allocated_caches_round_trip_through_kvtier_byte_exact(engine_id):
    config = SMALL.config(
        engine_id, cpu_tokens=256, tokens_per_chunk=32, model_name="m", kv_dtype="bf16"
    )
    caches = SMALL.allocate(24)
    fill(caches, 0)
    keys = prefix_keys(range(100), 32, salt="m/bf16")  # 3 full chunks, 6 blocks
    async with KVTier(config, caches) as kv:
        assert await kv.store(keys, [4, 5, 0, 1, 9, 8], "w") == 3
        assert await kv.lookup(keys, "r") == 3
        assert await kv.load(keys, [10, 11, 12, 13, 14, 15], "r") == 3
        kv.finish("r")
    for layer in caches:
        assert torch.equal(
            layer[[4, 5, 0, 1, 9, 8]].view(torch.uint8), layer[10:16].view(torch.uint8)
        )


@pytest.mark.parametrize(
    ("tokens", "tokens_per_chunk", "world_size", "chunks"),
    [(1, 64, 1, 1), (64, 64, 1, 1), (65, 64, 1, 2), (1800, 64, 1, 29), (1000, 16, 2, 63)],
)
def test_cpu_bytes_for_tokens_holds_whole_padded_chunks(
    tokens, tokens_per_chunk, world_size, chunks
):
    layout = PagedKVLayout(num_layers=3, num_kv_heads=1, head_dim=10, dtype=torch.float16)
    row = layout.kv_bytes_per_block * (tokens_per_chunk // 16) * world_size
    padded = -(-row // mmap.PAGESIZE) * mmap.PAGESIZE
    assert padded > row  # these geometries need page padding
    cpu_bytes = layout.cpu_bytes_for_tokens(
        tokens, tokens_per_chunk=tokens_per_chunk, world_size=world_size
    )
    assert cpu_bytes == chunks * padded


def test_config_sizes_the_primary_tier_for_the_tokens_asked(engine_id):
    config = SMOL.config(
        engine_id, cpu_tokens=1800, tokens_per_chunk=64, model_name="smol", kv_dtype="fp32"
    )
    assert config.kv_bytes_per_block == SMOL.kv_bytes_per_block
    assert config.tokens_per_block == 16
    assert config.extra_config["block_size"] == 64
    spec = OffloadingSpecFactory.create_spec(config)
    try:
        assert spec.get_manager().host.num_chunks == 29  # ceil(1800 / 64)
    finally:
        spec.shutdown()


#: A small primary tier of SMALL's, for the config tests.
SMALL_CONFIG = {"cpu_tokens": 64, "tokens_per_chunk": 16, "model_name": "m", "kv_dtype": "bf16"}


def test_config_with_secondary_tiers_uses_the_tiering_spec(engine_id, tmp_path):
    config = SMALL.config(
        engine_id,
        **SMALL_CONFIG,
        secondary_tiers=[{"type": "fs", "root_dir": str(tmp_path)}],
        eviction_policy="arc",
    )
    assert config.extra_config["spec_name"] == "TieringOffloadingSpec"
    assert config.extra_config["secondary_tiers"] == [{"type": "fs", "root_dir": str(tmp_path)}]
    assert config.extra_config["eviction_policy"] == "arc"
    assert SMALL.config(engine_id, **SMALL_CONFIG).extra_config["spec_name"] == "CPUOffloadingSpec"


def test_config_with_backpressure_alone_gets_a_spec_that_reads_it(engine_id):
    # The CPU spec refuses backpressure; the config must name one that takes it.
    config = SMALL.config(
        engine_id, **SMALL_CONFIG, backpressure={"high_water": 0.005, "low_water": 0.001}
    )
    assert config.extra_config["spec_name"] == "TieringOffloadingSpec"
    OffloadingSpecFactory.create_spec(config).shutdown()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: PagedKVLayout(0, 1, 1, torch.float32), "num_layers must be a positive integer"),
        (lambda: PagedKVLayout(1, 1, 1, "float32"), "dtype must be a torch.dtype"),  # type: ignore[arg-type]
        (lambda: SMALL.allocate(0), "num_blocks must be a positive integer"),
        (
            lambda: SMALL.cpu_bytes_for_tokens(10, tokens_per_chunk=24),
            "tokens_per_chunk must be a multiple of tokens_per_block=16, got 24",
        ),
        (lambda: SMALL.cpu_bytes_for_tokens(0, tokens_per_chunk=16), "tokens must be"),
        (
            lambda: SMALL.config(
                "e", cpu_tokens=16, tokens_per_chunk=16, model_name="", kv_dtype="x"
            ),
            "model_name must be a non-empty string",
        ),
        (
            lambda: SMALL.config(
                "e",
                cpu_tokens=16,
                tokens_per_chunk=16,
                model_name="m",
                kv_dtype="x",
                block_size=32,
            ),
            "block_size comes from cpu_tokens and tokens_per_chunk",
        ),
    ],
)
def test_bad_geometry_is_rejected_by_name(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()
