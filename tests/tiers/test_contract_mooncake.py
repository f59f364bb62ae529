"""The tier contract, run against the mooncake tier: two engines sharing one real
Mooncake master on loopback (tests/mooncake_server.py), each lending the pool a
segment of its own memory.

Stalls are real transfers held in the tier's own I/O thread: the next batch call of
one direction waits inside the thread, its rows referenced, before it calls Mooncake's
client, which then moves the chunk late (into the slot it was given, or out of it).
A damaged object is written over the tier's own by a client of the test's.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import pytest
from helpers import damaged
from mooncake_server import MooncakeMaster, RawStore, mooncake_tier

from kvtier import KVTier
from kvtier.format import HEADER_BYTES
from kvtier.keys import OffloadKey
from kvtier.testing import Stall, TierContract
from kvtier.tiers.mooncake import PROGRESS_TIMEOUT_VARIABLE, MooncakeTier

# Each test sets up two clients, and closing one that lends a segment takes about 2 s
# (it unmounts the segment): the module runs for about a minute.
pytestmark = pytest.mark.slow

# A held call gives up after this long, so that a test that never lets it go cannot
# leave a thread behind forever.
HOLD_LIMIT_S = 60.0


def mooncake(node: KVTier) -> MooncakeTier:
    tier = node.manager.tiers[0]
    assert isinstance(tier, MooncakeTier)
    return tier


class HeldClient:
    """A tier's Mooncake client whose next ``call`` waits in the calling thread until
    let go, then goes through; every other call goes straight through."""

    def __init__(self, client: Any, call: str, stall: Stall) -> None:
        self._client = client
        self._call = call
        self._stall = stall
        self._held = threading.Lock()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if name != self._call:
            return method

        def held(*args: Any) -> Any:
            if not self._held.acquire(blocking=False):
                return method(*args)
            self._stall.reach()
            self.release.wait(HOLD_LIMIT_S)
            try:
                return method(*args)
            finally:
                self._stall.finish()

        return held


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    """One master for the module's tests (each test's keys are its own): starting and
    stopping one takes about 2 s."""
    master = MooncakeMaster()
    asyncio.run(master.__aenter__())
    try:
        yield master
    finally:
        asyncio.run(master.__aexit__(None, None, None))


class TestMooncakeContract(TierContract):
    clears = False  # a namespace's objects cannot be listed

    @pytest.fixture(autouse=True)
    def _master(self, master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch) -> None:
        # The progress timeout the tiers put in the environment goes after each test.
        monkeypatch.delenv(PROGRESS_TIMEOUT_VARIABLE, raising=False)
        self.master = master
        self._raw: RawStore | None = None

    async def tier_config(self) -> Mapping[str, Any]:
        return mooncake_tier(self.master)

    async def raw(self) -> RawStore:
        """The test's own client, set up by the first test that needs it."""
        if self._raw is None:
            self._raw = await self.resources.enter_async_context(RawStore(self.master))
        return self._raw

    async def reader_tier_config(self, writer: KVTier) -> Mapping[str, Any]:
        return mooncake_tier(self.master)  # the same pool

    async def _rewrite(self, writer: KVTier, key: OffloadKey, how: str) -> None:
        name = mooncake(writer).object_name(key)
        raw = await self.raw()
        data = await raw.read(name)
        assert data is not None, f"the store holds no object {name}"
        await raw.write(name, damaged(data, how))

    async def corrupt(self, writer: KVTier, key: OffloadKey) -> None:
        await self._rewrite(writer, key, "flip_payload")

    async def truncate(self, writer: KVTier, key: OffloadKey) -> None:
        await self._rewrite(writer, key, "truncate")

    async def stored_chunk(self, writer: KVTier, key: OffloadKey) -> bytes | None:
        data = await (await self.raw()).read(mooncake(writer).object_name(key))
        return None if data is None else data[HEADER_BYTES:]

    @contextlib.asynccontextmanager
    async def _held(self, node: KVTier, call: str) -> AsyncIterator[Stall]:
        tier = mooncake(node)
        stall = Stall()
        client = tier._client
        held = HeldClient(client, call, stall)
        tier._client = held  # this engine's tier only
        try:
            yield stall
        finally:
            held.release.set()

    def stall_loads(self, node: KVTier, key: OffloadKey) -> Any:
        return self._held(node, "batch_get_into_multi_buffers")

    def stall_stores(self, node: KVTier) -> Any:
        return self._held(node, "batch_put_from_multi_buffers")
