"""The framework around a tier: a timed-out job's slots come back only when its I/O stops."""

from __future__ import annotations

import asyncio

import pytest
from helpers import keys, tiering_config
from scripted_tier import ThreadWritingTier

from kvtier import LookupResult, OffloadingSpecFactory, ReqContext
from kvtier.tiering.loop import HostLoop

pytestmark = pytest.mark.anyio


async def test_a_timed_out_load_s_thread_never_writes_into_a_reused_slot(engine_id):
    tier_config = {
        "type": "ThreadWritingTier",
        "module_path": "scripted_tier",
        "tag": "slow-thread",
        "job_timeout_s": 0.1,
    }
    spec = OffloadingSpecFactory.create_spec(tiering_config(engine_id, [tier_config], chunks=4))
    manager = spec.get_manager(loop=HostLoop())
    await manager.start()
    tier = ThreadWritingTier.instances["slow-thread"]
    view = manager.region.primary_view
    writer = ReqContext("writer")

    def store(key: bytes, fill: int) -> bool:
        out = manager.prepare_store([key], writer)
        if out is None:
            return False
        view[out.store_spec.chunk_ids[0]][:] = bytes([fill]) * len(view[0])
        manager.complete_store([key], writer)
        return True

    try:
        [promoted] = keys("promoted", 1)
        assert store(promoted, 0xEE)
        await manager.drain()
        await manager.areset_cache()  # only the tier holds it now
        tier.release.clear()
        reader = ReqContext("reader")
        assert manager.lookup(promoted, reader) is LookupResult.HIT_PENDING
        manager.on_schedule_end()
        while manager.lookup(promoted, reader) is not LookupResult.MISS:  # the job timed out
            await asyncio.wait_for(manager.wait_for_completions(), 10)
        # Store into every slot the primary tier will give, letting each cascade end.
        fills = dict(zip(keys("after", 8), range(1, 9), strict=True))
        for key, fill in fills.items():
            store(key, fill)
            await asyncio.sleep(0.01)
        tier.release.set()  # the thread writes its chunk into the slot it was given
        await asyncio.wait_for(manager.drain(), 10)
        assert tier.writes_done == 1
        for key, fill in fills.items():
            slot = manager.primary.slot_of(key)
            if slot is not None:
                assert bytes(view[slot]) == bytes([fill]) * len(view[0]), key
    finally:
        tier.release.set()
        await manager.aclose()
