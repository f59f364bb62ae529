"""Process bodies for the redis tier's two-engine test (imported by spawned children).

Each child is one engine with a redis tier: it stores its own chunks, waits until the
other engine's chunks are visible through the server, loads them and checks every byte
against what the other engine stored (the same pattern in every process). A failed
check or a wait that runs out ends the child with a non-zero exit code.
"""

from __future__ import annotations

import asyncio
import time

import torch
from helpers import keys, tiering_config

from kvtier import KVTier

BLOCK = 16 * 1024
GPU_BLOCKS = 32
CHUNKS = 8
MODEL = "redis-shared-model"
# Both children start together; the other's chunks show up within seconds here.
WAIT_S = 60.0


def pattern(seed: int) -> torch.Tensor:
    """The KV contents of engine ``seed``: the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (GPU_BLOCKS, BLOCK), dtype=torch.uint8, generator=generator)


def engine(engine_id: str, url: str, mine: int, theirs: int) -> None:
    """Store the chunks of engine ``mine``, then load those of engine ``theirs``."""

    async def run() -> None:
        config = tiering_config(
            engine_id,
            [{"type": "redis", "url": url}],
            chunks=2 * CHUNKS,
            kv_bytes_per_block=BLOCK,
            model_name=MODEL,
        )
        cache = pattern(mine).clone()
        async with KVTier(config, [cache]) as kv:
            own = keys(f"engine-{mine}", CHUNKS)
            assert await kv.store(own, list(range(CHUNKS)), "store") == CHUNKS
            await kv.drain()
            other = keys(f"engine-{theirs}", CHUNKS)
            deadline = time.monotonic() + WAIT_S
            attempt = 0
            while True:
                attempt += 1
                request = f"look-{attempt}"
                found = await kv.lookup(other, request, timeout=WAIT_S)
                if found == CHUNKS:
                    break
                kv.finish(request)
                assert time.monotonic() < deadline, f"only {found} chunks of the other engine"
                await asyncio.sleep(0.1)
            blocks = list(range(CHUNKS, 2 * CHUNKS))
            assert await kv.load(other, blocks, request) == CHUNKS
            kv.finish(request)
            expected = pattern(theirs)[:CHUNKS]
            assert torch.equal(cache[CHUNKS : 2 * CHUNKS], expected), "bytes differ"

    asyncio.run(run())
