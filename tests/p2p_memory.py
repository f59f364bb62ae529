"""p2p tiers on the in-memory transport, for fast tests of the reader and owner sides.

A :class:`MemoryNode` is a real :class:`PeerTier` over a bytearray primary region (on
the in-memory transport, or on any other: TCP on loopback with ``listen`` given). In
place of the manager, :class:`FakeManager` answers the tier's pin requests from a
key -> slot dictionary and counts the pins, so a test can see every pin released.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio

from kvtier._secrets import Secret
from kvtier.format import ChunkFormat
from kvtier.keys import OffloadKey
from kvtier.metrics import MetricsRecorder
from kvtier.region import PrimaryView
from kvtier.resources import resolve_threadsafe
from kvtier.tiers.base import JobResult, PrimaryAccess, TierContext, TransferJob
from kvtier.tiers.p2p import MemoryTransport, PeerTier
from kvtier.tiers.p2p.channel import Channel, Transport
from kvtier.tiers.p2p.handshake import PROTOCOL_VERSION, Credentials, Remote

CHUNK = 4096
NAMESPACE = "kvtier/p2p-memory-test"
SECRET = "memory-transport-test-secret-0123"
# Every wait below ends as soon as what it waits for happens; the bound only turns a
# hang into a failure.
HANG_S = 10


class FakeManager:
    """A PinBackend in the manager's place: pins the keys it holds, counts the pins."""

    def __init__(self, view: PrimaryView) -> None:
        self.view = view
        self.slots: dict[OffloadKey, int] = {}
        self.pins: Counter[OffloadKey] = Counter()

    def request_pins(
        self,
        keys: tuple[OffloadKey, ...],
        future: asyncio.Future[dict[OffloadKey, memoryview]],
    ) -> None:
        rows = {k: self.view[self.slots[k]] for k in keys if k in self.slots}
        self.pins.update(list(rows))
        resolve_threadsafe(future, rows)

    def release_pins(self, keys: tuple[OffloadKey, ...]) -> None:
        self.pins.subtract(keys)

    @property
    def pinned(self) -> int:
        return sum(count for count in self.pins.values() if count)


class MemoryNode:
    """A p2p tier named ``name`` listening on ``name:7070`` of ``transport`` (or where
    ``listen`` says; ``address`` is the bound one once started)."""

    def __init__(
        self,
        transport: Transport,
        name: str,
        *,
        chunks: int = 8,
        clock: Callable[[], float] | None = None,
        **params: Any,
    ) -> None:
        self.region = bytearray(chunks * CHUNK)
        self.view = PrimaryView(memoryview(self.region), chunks, CHUNK)
        self.manager = FakeManager(self.view)
        access = PrimaryAccess(self.view)
        access.bind(self.manager)
        self.metrics = MetricsRecorder(PeerTier.build_metric_definitions({}))
        self.ctx = TierContext(
            primary_view=self.view,
            chunk_bytes=CHUNK,
            namespace=NAMESPACE,
            tier_name=name,
            metrics=self.metrics,
            primary=access,
        )
        params = {"secret": SECRET, "listen": f"{name}:7070", **params}
        settings = PeerTier.settings_for(self.ctx, params)
        self.tier = PeerTier(self.ctx, settings, transport=transport, clock=clock)
        self.address = self.tier.listen_address
        self._jobs = 0

    async def __aenter__(self) -> MemoryNode:
        await self.tier.start()
        self.address = self.tier.listen_address
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.tier.aclose()

    async def put(self, keys: list[OffloadKey], slots: list[int]) -> list[bytes]:
        """Fill ``slots`` with random bytes for ``keys`` and store (announce) them."""
        contents = []
        for key, slot in zip(keys, slots, strict=True):
            data = os.urandom(CHUNK)
            self.view[slot][:] = data
            self.manager.slots[key] = slot
            contents.append(data)
        result = await self.tier.store(self._job(keys, slots, promotion=False))
        assert result.success
        return contents

    async def pull(self, keys: list[OffloadKey], slots: list[int]) -> JobResult:
        return await self.tier.load(self._job(keys, slots, promotion=True))

    def counter(self, name: str) -> float:
        return self.metrics.sample(f"{name}_total", {"tier": self.ctx.tier_name}) or 0.0

    def _job(self, keys: list[OffloadKey], slots: list[int], *, promotion: bool) -> TransferJob:
        self._jobs += 1
        return TransferJob(self._jobs, tuple(keys), tuple(slots), promotion, f"r{self._jobs}")


async def until(predicate: Callable[[], bool]) -> None:
    """Wait until ``predicate()`` holds (yielding to the loop in between).

    What the tests wait for (a count, an index entry) signals no event, so this polls.
    """
    with anyio.fail_after(HANG_S):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.001)


async def dial(
    transport: MemoryTransport,
    address: str,
    *,
    secret: str = SECRET,
    version: int = PROTOCOL_VERSION,
) -> tuple[Channel, Remote]:
    """An authenticated reader's channel to the node at ``address`` (proposing protocol
    ``version``), and that node."""
    host, port = address.rsplit(":", 1)
    channel = await transport.connect(host, int(port))
    credentials = Credentials(
        Secret(secret.encode()), os.urandom(16), ChunkFormat(NAMESPACE).digest
    )
    try:
        with anyio.fail_after(HANG_S):
            return await credentials.as_reader(channel, host, version)
    except BaseException:
        channel.close()
        raise
