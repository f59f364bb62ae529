"""Process bodies for the multi-process fs tier tests (imported by spawned children)."""

from __future__ import annotations

import asyncio

import torch
from helpers import keys, tiering_config

from kvtier import KVTier

BLOCK = 16 * 1024
GPU_BLOCKS = 64


def pattern(seed: int) -> torch.Tensor:
    """The same KV contents in every process: key i's block holds i's pattern."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 255, (GPU_BLOCKS, BLOCK), dtype=torch.uint8, generator=gen)


def write_same_keys(engine_id: str, root_dir: str, count: int) -> None:
    async def run() -> None:
        config = tiering_config(
            engine_id,
            [{"type": "fs", "root_dir": root_dir}],
            chunks=count,
            kv_bytes_per_block=BLOCK,
            model_name="shared-model",
        )
        async with KVTier(config, [pattern(7)]) as kv:
            for _ in range(3):  # store, then again after the primary forgot them
                assert await kv.store(keys("shared", count), list(range(count)), "writer") == count
                await kv.drain()
                await kv.reset()

    asyncio.run(run())
