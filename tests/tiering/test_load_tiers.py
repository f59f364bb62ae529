"""Which tiers a request may load from (``ReqContext.load_tiers``, vLLM's
``kv_load_tiers``), and which tier served each chunk it promoted."""

from __future__ import annotations

import pytest
from helpers import keys, scripted
from scripted_tier import ScriptedTier
from tiering_helpers import HIT, MISS, evict_all, fill, opened, resolve

from kvtier import ReqContext

pytestmark = pytest.mark.anyio


async def test_a_request_loads_only_from_the_tiers_it_names(engine_id):
    tiers = [scripted("near", instant=True), scripted("far", instant=True)]
    async with opened(engine_id, tiers, chunks=8) as manager:
        near, far = manager.diagnostics.tier_labels
        ks = keys("filtered", 2)
        fill(manager, ks)
        await manager.drain()
        await evict_all(manager, manager.host.num_chunks)
        del ScriptedTier.instances["near"].chunks[ks[1]]  # only the far tier has it
        # Not allowed any secondary tier: both are misses, and no tier is asked.
        none = ReqContext("none", load_tiers=frozenset())
        assert [await resolve(manager, key, none) for key in ks] == [MISS, MISS]
        assert not ScriptedTier.instances["near"].load_jobs
        assert not ScriptedTier.instances["far"].load_jobs
        # Allowed the far tier only: the key the near tier holds too comes from far.
        only_far = ReqContext("far", load_tiers=frozenset({far}))
        assert [await resolve(manager, key, only_far) for key in ks] == [HIT, HIT]
        assert manager.host.load_source(ks[0], only_far) == far
        assert manager.host.load_source(ks[1], only_far) == far
        assert not ScriptedTier.instances["near"].load_jobs
        manager.on_request_finished(only_far)  # lets go of the chunks kept for it
        await evict_all(manager, manager.host.num_chunks)
        # Every tier (the default): the first that holds a key promotes it.
        anyone = ReqContext("any")
        assert [await resolve(manager, key, anyone) for key in ks] == [HIT, HIT]
        assert manager.host.load_source(ks[0], anyone) == near
        assert manager.host.load_source(ks[1], anyone) == far


async def test_a_chunk_found_in_the_primary_tier_has_no_secondary_source(engine_id):
    async with opened(engine_id, [scripted("src", instant=True)], chunks=8) as manager:
        [key] = keys("resident", 1)
        fill(manager, [key])
        req = ReqContext("reader")
        assert await resolve(manager, key, req) is HIT
        assert manager.host.load_source(key, req) is None


async def test_a_finished_request_forgets_where_its_chunks_came_from(engine_id):
    async with opened(engine_id, [scripted("gone", instant=True)], chunks=8) as manager:
        [label] = manager.diagnostics.tier_labels
        [key] = keys("forgotten", 1)
        fill(manager, [key])
        await manager.drain()
        await evict_all(manager, manager.host.num_chunks)
        req = ReqContext("reader")
        assert await resolve(manager, key, req) is HIT
        assert manager.host.load_source(key, req) == label
        manager.on_request_finished(req)
        assert manager.host.load_source(key, req) is None
