"""The tier contract, run against the memcached tier: two engines sharing one memcached
server on loopback (tests/memcached_server.py), which can hold an answer back.

A stalled load is a ``get`` whose answer the server holds; a stalled store an ``add``
whose answer it holds (the item itself is stored).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from helpers import damaged
from memcached_server import MemcachedServer

from kvtier import KVTier
from kvtier.format import HEADER_BYTES
from kvtier.keys import OffloadKey
from kvtier.testing import Stall, TierContract
from kvtier.tiers.memcached import MemcachedTier

ITEM_BYTES = 8 << 20


def memcached_tier(node: KVTier) -> MemcachedTier:
    tier = node.manager.tiers[0]
    assert isinstance(tier, MemcachedTier)
    return tier


class TestMemcachedContract(TierContract):
    # The tier closes the connection of a request its job gave up on: nothing is late.
    stops_io_when_cancelled = True
    clears = False  # memcached cannot list a namespace's items

    async def tier_config(self) -> Mapping[str, Any]:
        self.server = await self.resources.enter_async_context(
            MemcachedServer(max_item_bytes=ITEM_BYTES)
        )
        return {"type": "memcached", "server": self.server.address, "max_item_bytes": ITEM_BYTES}

    async def reader_tier_config(self, writer: KVTier) -> Mapping[str, Any]:
        return {"type": "memcached", "server": self.server.address, "max_item_bytes": ITEM_BYTES}

    def _name(self, writer: KVTier, key: OffloadKey) -> bytes:
        return memcached_tier(writer).item_name(key).encode()

    async def corrupt(self, writer: KVTier, key: OffloadKey) -> None:
        name = self._name(writer, key)
        self.server.items[name] = damaged(self.server.items[name], "flip_payload")

    async def truncate(self, writer: KVTier, key: OffloadKey) -> None:
        name = self._name(writer, key)
        self.server.items[name] = damaged(self.server.items[name], "truncate")

    async def stored_chunk(self, writer: KVTier, key: OffloadKey) -> bytes | None:
        item = self.server.items.get(self._name(writer, key))
        return None if item is None else item[HEADER_BYTES:]

    @contextlib.asynccontextmanager
    async def stall_loads(self, node: KVTier, key: OffloadKey) -> AsyncIterator[Stall]:
        with self.server.hold_next(b"get") as stall:
            yield stall

    @contextlib.asynccontextmanager
    async def stall_stores(self, node: KVTier) -> AsyncIterator[Stall]:
        with self.server.hold_next(b"add") as stall:
            yield stall
