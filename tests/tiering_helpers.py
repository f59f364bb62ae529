"""Managers for the tiering tests: opened on the test's loop, filled, settled."""

from __future__ import annotations

import contextlib

from helpers import keys, tiering_config
from scripted_tier import ScriptedTier

from kvtier import LookupResult, OffloadingSpecFactory, ReqContext, TieringOffloadingManager
from kvtier.tiering.loop import HostLoop

HIT, PENDING, MISS, RETRY = (
    LookupResult.HIT,
    LookupResult.HIT_PENDING,
    LookupResult.MISS,
    LookupResult.RETRY,
)


@contextlib.asynccontextmanager
async def opened(engine_id, tiers, **kw):
    """A started manager on the test's event loop, always closed afterwards."""
    spec = OffloadingSpecFactory.create_spec(tiering_config(engine_id, tiers, **kw))
    manager = spec.get_manager(loop=HostLoop())
    try:
        await manager.start()
        yield manager
    finally:
        for tier in ScriptedTier.instances.values():
            tier.gate.set()
        await manager.aclose()
        await spec.aclose()


WRITER = ReqContext("writer")


def fill(manager: TieringOffloadingManager, ks, req=WRITER) -> None:
    """Store ``ks`` into the primary tier, writing a recognisable pattern into each slot."""
    out = manager.prepare_store(ks, req)
    assert out is not None
    for key, slot in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
        row = manager.region.primary_view[slot]
        row[:] = (key * (len(row) // len(key) + 1))[: len(row)]
    manager.complete_store(ks, req)


async def evict_all(manager, count: int) -> None:
    """Push everything out of the primary tier with other keys, and let cascades end."""
    fill(manager, keys("filler", count), ReqContext("filler"))
    await manager.drain()


async def settle(manager) -> None:
    await manager.drain()


async def resolve(manager, key, req) -> LookupResult:
    """Look ``key`` up, stepping until the answer is no longer RETRY or HIT_PENDING."""
    for _ in range(20):
        mark = manager.host.completion_mark
        result = manager.lookup(key, req)
        if result in (HIT, MISS):
            return result
        manager.on_schedule_end()
        await manager.wait_for_completions(since=mark)
    raise AssertionError("the lookup never settled")
