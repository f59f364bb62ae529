"""The bench's stand-in engine: what it checks in a loaded chunk is what it computed."""

from __future__ import annotations

import pytest
from helpers import make_config

from kvtier import KVTier
from kvtier.bench.engine import Engine, kv_caches
from kvtier.bench.settings import BenchSettings
from kvtier.bench.workloads import BenchRequest, chain_keys

pytestmark = pytest.mark.anyio

CHUNK_BYTES = 64 * 1024


@pytest.fixture
def settings() -> BenchSettings:
    return BenchSettings(chunk_bytes=CHUNK_BYTES)


async def test_a_chunk_served_with_other_bytes_is_counted_wrong(engine_id, settings):
    caches = kv_caches(settings, 16)
    config = make_config(
        engine_id, kv_bytes_per_block=CHUNK_BYTES, cpu_bytes_to_use=8 * CHUNK_BYTES
    )
    async with KVTier(config, caches) as kv:
        engine = Engine(kv, caches, 16, timeout=10)
        try:
            request = BenchRequest("stored", (1, 2, 3))
            assert await engine.compute_and_store(chain_keys(request.blocks), "w") == 3
            served = await engine.serve(BenchRequest("clean", request.blocks))
            assert (served.hits, served.wrong_chunks) == (3, 0)
            # One byte of the second chunk's slot changes under the tier's feet.
            slot = kv.manager.primary.slot_of(chain_keys(request.blocks)[1])
            assert slot is not None
            row = kv.manager.region.primary_view[slot]
            row[CHUNK_BYTES // 3] ^= 0xFF
            served = await engine.serve(BenchRequest("dirty", request.blocks))
            assert (served.hits, served.wrong_chunks) == (3, 1)
        finally:
            await engine.aclose()
