"""The tier contract, run against the redis tier: two engines sharing one real Redis
server on loopback (tests/redis_server.py), both talking to it through a holding proxy
that frames Redis's commands.

A stalled load is a ``GET`` whose answer the proxy holds back; a stalled store a
``SET`` whose answer it holds back (the value itself reaches the server). A damaged
value is written over the tier's own with a plain ``SET``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from helpers import damaged
from redis_server import RedisProxy, RedisServer, valkey_binary

from kvtier import KVTier
from kvtier.format import HEADER_BYTES
from kvtier.keys import OffloadKey
from kvtier.testing import Stall, TierContract
from kvtier.tiers.redis import RedisTier


def redis_tier(node: KVTier) -> RedisTier:
    tier = node.manager.tiers[0]
    assert isinstance(tier, RedisTier)
    return tier


class TestRedisContract(TierContract):
    # redis-py closes the connection of a request its job gave up on: nothing is late.
    stops_io_when_cancelled = True

    def server_binary(self) -> str | None:
        """The server to run; None: redis-server."""
        return None

    async def tier_config(self) -> Mapping[str, Any]:
        self.server = await self.resources.enter_async_context(
            RedisServer(binary=self.server_binary())
        )
        self.proxy = await self.resources.enter_async_context(
            RedisProxy(("127.0.0.1", self.server.port))
        )
        return {"type": "redis", "url": f"redis://{self.proxy.address}/0"}

    async def reader_tier_config(self, writer: KVTier) -> Mapping[str, Any]:
        return {"type": "redis", "url": f"redis://{self.proxy.address}/0"}  # the same server

    async def _rewrite(self, writer: KVTier, key: OffloadKey, how: str) -> None:
        name = redis_tier(writer).value_name(key)
        value = await self.server.read_value(name)
        assert value is not None, f"the server holds no value {name}"
        await self.server.write_value(name, damaged(value, how))

    async def corrupt(self, writer: KVTier, key: OffloadKey) -> None:
        await self._rewrite(writer, key, "flip_payload")

    async def truncate(self, writer: KVTier, key: OffloadKey) -> None:
        await self._rewrite(writer, key, "truncate")

    async def stored_chunk(self, writer: KVTier, key: OffloadKey) -> bytes | None:
        value = await self.server.read_value(redis_tier(writer).value_name(key))
        return None if value is None else value[HEADER_BYTES:]

    @contextlib.asynccontextmanager
    async def stall_loads(self, node: KVTier, key: OffloadKey) -> AsyncIterator[Stall]:
        with self.proxy.hold_next("get") as stall:
            yield stall

    @contextlib.asynccontextmanager
    async def stall_stores(self, node: KVTier) -> AsyncIterator[Stall]:
        with self.proxy.hold_next("set") as stall:
            yield stall


class TestValkeyContract(TestRedisContract):
    """The same contract against Valkey, which speaks Redis's protocol."""

    def server_binary(self) -> str | None:
        return valkey_binary()
