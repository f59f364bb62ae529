"""The tier contract, run against the s3 tier: two engines sharing one bucket of a
real S3 server on loopback (moto; SeaweedFS), both talking to it through a holding
proxy.

A stalled load is a GET whose answer the proxy holds back; a stalled store a PUT whose
answer it holds back (the object itself reaches the server).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import pytest
from helpers import damaged
from holding_proxy import HoldingProxy
from s3_servers import (
    ACCESS_KEY,
    SECRET_KEY,
    MotoServer,
    S3Server,
    SeaweedS3Server,
    fresh_bucket,
    put_object,
    read_object,
)

from kvtier import KVTier
from kvtier.format import HEADER_BYTES
from kvtier.keys import OffloadKey
from kvtier.testing import Stall, TierContract
from kvtier.tiers.s3 import S3Tier


def s3_tier(node: KVTier) -> S3Tier:
    tier = node.manager.tiers[0]
    assert isinstance(tier, S3Tier)
    return tier


class TestS3Contract(TierContract):
    # The tier ends a request itself at its own deadline, before the framework's
    # timeout, and a cancelled request reads nothing more into its slot.
    stops_io_when_cancelled = True

    server: S3Server

    @pytest.fixture(autouse=True)
    def _server(self, moto: MotoServer, bucket: str) -> None:
        self.server = moto
        self.bucket = bucket

    async def tier_config(self) -> Mapping[str, Any]:
        self.proxy = await self.resources.enter_async_context(
            HoldingProxy(("127.0.0.1", self.server.port), http=True)
        )
        self.tier = {
            "type": "s3",
            "bucket": self.bucket,
            "endpoint_url": self.proxy.endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
        }
        return self.tier

    async def reader_tier_config(self, writer: KVTier) -> Mapping[str, Any]:
        return self.tier  # another engine on the same bucket

    async def _rewrite(self, writer: KVTier, key: OffloadKey, how: str) -> None:
        name = s3_tier(writer).object_key(key)
        data = await read_object(self.server.endpoint, self.bucket, name)
        assert data is not None
        await put_object(self.server.endpoint, self.bucket, name, damaged(data, how))

    async def corrupt(self, writer: KVTier, key: OffloadKey) -> None:
        await self._rewrite(writer, key, "flip_payload")

    async def truncate(self, writer: KVTier, key: OffloadKey) -> None:
        await self._rewrite(writer, key, "truncate")

    async def stored_chunk(self, writer: KVTier, key: OffloadKey) -> bytes | None:
        name = s3_tier(writer).object_key(key)
        data = await read_object(self.server.endpoint, self.bucket, name)
        return None if data is None else data[HEADER_BYTES:]

    @contextlib.asynccontextmanager
    async def stall_loads(self, node: KVTier, key: OffloadKey) -> AsyncIterator[Stall]:
        with self.proxy.hold_next("GET") as stall:
            yield stall

    @contextlib.asynccontextmanager
    async def stall_stores(self, node: KVTier) -> AsyncIterator[Stall]:
        with self.proxy.hold_next("PUT") as stall:
            yield stall


@pytest.mark.slow
class TestS3ContractSeaweedFS(TestS3Contract):
    """The same contract against SeaweedFS, a real S3 server binary."""

    @pytest.fixture(autouse=True)
    def _server(self, seaweed: SeaweedS3Server) -> Iterator[None]:
        self.server = seaweed
        with fresh_bucket(seaweed.endpoint) as bucket:
            self.bucket = bucket
            yield
