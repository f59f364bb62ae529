"""The tier contract, run against the p2p tier: two engines in this process over
loopback TCP, the reader dialing the owner through a holding proxy.

The owner's primary tier is what the p2p tier serves, so the writer gets room there
for the whole round trip. A stalled load is a fetch whose chunk the proxy holds back.
A p2p store only announces keys to peers (no chunk bytes move), so there is no store
to stall; a chunk on the wire cannot be cut short either (frames have a fixed size:
a short one is a protocol error, tested in test_tier.py and test_reader.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
from holding_proxy import HoldingProxy
from p2p_procs import p2p_tier, peer_tier

from kvtier import KVTier, ReqContext
from kvtier.keys import OffloadKey
from kvtier.testing import Stall, TierContract


class TestP2pContract(TierContract):
    # A cancelled load aborts its link to the peer: no byte of it reaches a slot later.
    stops_io_when_cancelled = True
    writer_primary_chunks = 32

    async def tier_config(self) -> Mapping[str, Any]:
        return p2p_tier()

    async def reader_tier_config(self, writer: KVTier) -> Mapping[str, Any]:
        self.proxy = await self.resources.enter_async_context(
            HoldingProxy(peer_tier(writer).address)
        )
        return p2p_tier(peers=[self.proxy.address])

    async def corrupt(self, writer: KVTier, key: OffloadKey) -> None:
        # The owner's copy is its primary slot: a bit flips in its memory after the
        # chunk was announced (and its checksum taken).
        req = ReqContext("corrupt")
        [slot] = writer.manager.prepare_load([key], req).chunk_ids
        writer.manager.region.primary_view[slot][100] ^= 0x01
        writer.manager.complete_load([key], req)

    async def truncate(self, writer: KVTier, key: OffloadKey) -> None:
        pytest.skip("p2p chunk frames have a fixed size: a short one is a protocol error")

    @contextlib.asynccontextmanager
    async def stall_loads(self, node: KVTier, key: OffloadKey) -> AsyncIterator[Stall]:
        with self.proxy.hold_next() as stall:
            yield stall

    def stall_stores(self, node: KVTier) -> contextlib.AbstractAsyncContextManager[Stall]:
        pytest.skip("a p2p store only announces keys: no chunk bytes move, nothing can stall")
