"""The tier contract, run against the memcached tier: two engines sharing one real
memcached server on loopback (tests/memcached_server.py), both talking to it through a
holding proxy that frames memcached's commands.

A stalled load is a ``get`` whose answer the proxy holds back; a stalled store an
``add`` whose answer it holds back (the item itself reaches the server). A damaged
item is written over the tier's own with a plain ``set``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from helpers import damaged
from memcached_server import MemcachedProxy, MemcachedServer

from kvtier import KVTier
from kvtier.format import HEADER_BYTES
from kvtier.keys import OffloadKey
from kvtier.testing import Stall, TierContract
from kvtier.tiers.memcached import MemcachedTier


def memcached_tier(node: KVTier) -> MemcachedTier:
    tier = node.manager.tiers[0]
    assert isinstance(tier, MemcachedTier)
    return tier


class TestMemcachedContract(TierContract):
    # The tier closes the connection of a request its job gave up on: nothing is late.
    stops_io_when_cancelled = True
    clears = False  # memcached cannot list a namespace's items

    async def tier_config(self) -> Mapping[str, Any]:
        self.server = await self.resources.enter_async_context(MemcachedServer())
        self.proxy = await self.resources.enter_async_context(
            MemcachedProxy(("127.0.0.1", self.server.port))
        )
        return {"type": "memcached", "server": self.proxy.address}

    async def reader_tier_config(self, writer: KVTier) -> Mapping[str, Any]:
        return {"type": "memcached", "server": self.proxy.address}  # the same server

    async def _rewrite(self, writer: KVTier, key: OffloadKey, how: str) -> None:
        name = memcached_tier(writer).item_name(key)
        item = await self.server.read_item(name)
        assert item is not None, f"the server holds no item {name}"
        await self.server.write_item(name, damaged(item, how))

    async def corrupt(self, writer: KVTier, key: OffloadKey) -> None:
        await self._rewrite(writer, key, "flip_payload")

    async def truncate(self, writer: KVTier, key: OffloadKey) -> None:
        await self._rewrite(writer, key, "truncate")

    async def stored_chunk(self, writer: KVTier, key: OffloadKey) -> bytes | None:
        item = await self.server.read_item(memcached_tier(writer).item_name(key))
        return None if item is None else item[HEADER_BYTES:]

    @contextlib.asynccontextmanager
    async def stall_loads(self, node: KVTier, key: OffloadKey) -> AsyncIterator[Stall]:
        with self.proxy.hold_next("get") as stall:
            yield stall

    @contextlib.asynccontextmanager
    async def stall_stores(self, node: KVTier) -> AsyncIterator[Stall]:
        with self.proxy.hold_next("add") as stall:
            yield stall
