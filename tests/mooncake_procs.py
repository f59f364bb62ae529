"""Process bodies for the multi-process mooncake tier tests (imported by spawned children).

``lend_segment`` is a Mooncake node that only lends the pool memory; ``engine`` runs a
real kvtier engine with a mooncake tier and obeys commands sent over a pipe. Both
inherit ``MC_TCP_BIND_ADDRESS`` from the test process (set by mooncake_server), so
their transfers stay on 127.0.0.1. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
from helpers import keys, tiering_config

from kvtier import KVTier

BLOCK = 16 * 1024  # bytes per GPU block and per chunk (one block per chunk)
GPU_BLOCKS = 64
CHUNKS = 8
TIMEOUT_S = 60.0


def pattern(seed: int) -> torch.Tensor:
    """KV contents of an engine: block i of seed s is the same in every process."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 255, (GPU_BLOCKS, BLOCK), dtype=torch.uint8, generator=gen)


def lend_segment(master: str, metadata_server: str, segment_bytes: int, conn: Connection) -> None:
    """A Mooncake node lending ``segment_bytes`` until the test kills it (or says so)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    code = client.setup("127.0.0.1", metadata_server, segment_bytes, 0, "tcp", "", master)
    conn.send(("ready", code))
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and not conn.poll(0.5):
        pass
    client.close()


def engine(engine_id: str, tier: dict[str, Any], model: str, seed: int, conn: Connection) -> None:
    """An engine of ``model`` whose GPU holds ``pattern(seed)``, obeying ``conn``."""
    asyncio.run(_engine(engine_id, tier, model, seed, conn))


async def _engine(
    engine_id: str, tier: dict[str, Any], model: str, seed: int, conn: Connection
) -> None:
    config = tiering_config(
        engine_id, [tier], chunks=CHUNKS, kv_bytes_per_block=BLOCK, model_name=model
    )
    cache = pattern(seed)
    async with KVTier(config, [cache]) as kv:
        conn.send(("ready",))
        while True:
            if not await asyncio.to_thread(conn.poll, TIMEOUT_S):
                return
            command = conn.recv()
            if command[0] == "exit":
                conn.send(("bye",))
                return
            conn.send(await _obey(kv, cache, command))


async def _obey(kv: KVTier, cache: torch.Tensor, command: tuple[Any, ...]) -> Any:
    name, prefix, count = command[:3]
    ks = keys(prefix, count)
    if name == "store":
        # Blocks 0..count-1 of this engine's pattern, then out of its primary tier.
        for i in range(0, count, CHUNKS):
            part = ks[i : i + CHUNKS]
            assert await kv.store(part, list(range(i, i + len(part))), f"s-{prefix}-{i}") == len(
                part
            )
            await kv.drain()
        await kv.reset()
        return ("stored", count)
    if name == "read":
        # Into blocks 32.., compared with block 0.. of the pattern that stored them.
        expected = pattern(command[3])
        hits = loaded = 0
        for i in range(0, count, CHUNKS):
            part = ks[i : i + CHUNKS]
            request = f"r-{prefix}-{i}"
            found = await kv.lookup(part, request, timeout=TIMEOUT_S)
            hits += found
            if found:
                blocks = list(range(32 + i, 32 + i + found))
                loaded += await kv.load(part[:found], blocks, request)
            kv.finish(request)
            await kv.reset()
        exact = loaded == count and torch.equal(cache[32 : 32 + count], expected[:count])
        return ("read", hits, loaded, exact)
    raise ValueError(f"unknown command {name!r}")
