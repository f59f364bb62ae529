"""What a tier that talks to a server must survive, run against each such tier's real
server: the server killed mid-run, and restarted while the tier sat idle.

Each scenario takes a running server (a :class:`~server_process.ServerProcess`, which
can be killed and started again on its port) and the tier's mapping naming it, and
drives a whole engine through it: the first tier of the configuration is the one
under test.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from helpers import keys, store_all, tiering_config
from server_process import ServerProcess

from kvtier import KVTier
from kvtier.metrics import Names

__all__ = ["server_killed_mid_run", "server_restarted_while_idle"]


def failures(kv: KVTier, name: str, tier: str) -> float:
    kv.manager.on_schedule_end()  # flushes the step's counts
    return kv.manager.metrics.sample(f"{name}_total", {"tier": tier}) or 0.0


def _engine(
    engine_id: str, tier_params: Mapping[str, Any], chunk: int, seed: int
) -> tuple[dict[str, Any], torch.Tensor, str]:
    config = tiering_config(engine_id, [dict(tier_params)], chunks=8, kv_bytes_per_block=chunk)
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randint(0, 256, (64, chunk), dtype=torch.uint8, generator=generator)
    return config, cache, f"1:{tier_params['type']}"


async def server_killed_mid_run(
    engine_id: str, server: ServerProcess, tier_params: Mapping[str, Any], chunk: int
) -> None:
    """The server dies under open connections: lookups, loads and stores fail as
    counted misses; back on its port, empty, what it held is a plain miss, and the tier
    stores and loads through it again, byte-exact."""
    config, cache, tier = _engine(engine_id, tier_params, chunk, seed=3)
    async with KVTier(config, [cache]) as kv:
        before, during, after = keys("before", 4), keys("during", 4), keys("after", 4)
        await store_all(kv, before)
        await kv.reset()
        # The tier holds open connections to the server when it dies.
        await server.kill()
        assert await kv.lookup(before, "down", timeout=30) == 0
        kv.finish("down")
        await store_all(kv, during, first_block=10)
        lost = failures(kv, Names.LOOKUP_FAILURES, tier)
        assert lost + failures(kv, Names.PROMOTION_JOB_FAILURES, tier)
        assert failures(kv, Names.CASCADE_JOB_FAILURES, tier) >= 1
        # Back on the same port, empty: what the dead server held is a plain miss.
        await server.start()
        await kv.reset()
        assert await kv.lookup(before + during, "gone", timeout=30) == 0
        kv.finish("gone")
        assert failures(kv, Names.INTEGRITY_FAILURES, tier) == 0
        # And the tier stores and loads through the new server, byte-exact.
        await store_all(kv, after, first_block=20)
        await kv.reset()
        assert await kv.lookup(after, "back", timeout=30) == 4
        assert await kv.load(after, [40, 41, 42, 43], "back") == 4
        kv.finish("back")
        assert torch.equal(cache[40:44], cache[20:24])


async def server_restarted_while_idle(
    engine_id: str, server: ServerProcess, tier_params: Mapping[str, Any], chunk: int
) -> None:
    """The server restarts while the tier keeps idle connections to it: the next
    stores find them dead and reconnect, losing none."""
    config, cache, tier = _engine(engine_id, tier_params, chunk, seed=4)
    async with KVTier(config, [cache]) as kv:
        await store_all(kv, keys("warm", 4))  # the tier keeps its connections open
        await server.kill()
        await server.start()
        after = keys("after", 4)
        await store_all(kv, after, first_block=20)
        assert failures(kv, Names.CASCADE_JOB_FAILURES, tier) == 0
        await kv.reset()
        assert await kv.lookup(after, "back", timeout=30) == 4
        assert await kv.load(after, [40, 41, 42, 43], "back") == 4
        kv.finish("back")
        assert torch.equal(cache[40:44], cache[20:24])
