"""The engines a contract test runs: storing through them, reading back, checking bytes.

A node is a :class:`~kvtier.KVTier` over a CPU tensor standing in for its GPU, with
the tier under test as its only secondary tier; a test has a writer and a reader, the
same node when the tier has no second node to read through.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio
import torch
from prometheus_client import CollectorRegistry

from kvtier.facade import KVTier
from kvtier.keys import OffloadKey
from kvtier.testing._metrics import LATE_COMPLETIONS, QUARANTINED_SLOTS, has_metric, metric_value
from kvtier.tiers.base import SecondaryTier

__all__ = ["ROOM_WAIT_S", "WAIT_S", "Node", "Nodes", "until"]

# Waits that end as soon as what they wait for happens: the bound only turns a hang
# into a failure naming what never came.
WAIT_S = 20.0
# What the contract's waits poll at: what they wait for (a thread in a syscall, a
# metric) signals no event.
_POLL_S = 0.01
# How long a store made while a stalled job holds a slot waits for room: that slot
# does not come back before the stall ends, the others do within a cascade or two.
ROOM_WAIT_S = 0.5


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Wait until ``predicate()`` holds, polling (see _POLL_S); fail after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {WAIT_S:g} s waiting for {what}")
        await anyio.sleep(_POLL_S)


@dataclass(eq=False, repr=False)
class Node:
    """One engine of a contract test and the CPU tensor standing in for its GPU."""

    kv: KVTier
    cache: torch.Tensor
    _next_block: int = 0

    @property
    def tier(self) -> SecondaryTier:
        """The tier under test, as this node's manager runs it."""
        return self.kv.manager.tiers[0]

    @property
    def label(self) -> str:
        """The tier's label in metrics and events (``"1:fs"``)."""
        return self.kv.manager.diagnostics.tier_labels[0]

    @property
    def registry(self) -> CollectorRegistry:
        return self.kv.registry

    @property
    def primary_chunks(self) -> int:
        return self.kv.num_chunks

    def blocks(self, count: int) -> list[int]:
        """``count`` GPU blocks no call in flight uses: they go round the tensor."""
        total = self.cache.shape[0]
        assert count <= total, f"{count} blocks asked of a {total}-block tensor"
        blocks = [(self._next_block + i) % total for i in range(count)]
        self._next_block = (self._next_block + count) % total
        return blocks

    def metric(self, name: str) -> float:
        """The tier's sample of ``name`` (0 when it has none yet)."""
        return metric_value(self.registry, name, self.label) or 0.0

    async def visible(self, keys: Sequence[OffloadKey]) -> None:
        """Wait until the tier finds every key (another node's stores, announcements)."""
        tier = self.tier
        deadline = time.monotonic() + WAIT_S
        while not all(await tier.lookup(keys)):
            if time.monotonic() > deadline:
                raise AssertionError(f"the reader's tier never found {len(keys)} stored chunk(s)")
            await anyio.sleep(_POLL_S)

    async def invisible(self, keys: Sequence[OffloadKey]) -> None:
        """Wait until the tier finds none of ``keys`` (another node's removals,
        withdrawals and cached answers reach it in their own time)."""
        tier = self.tier
        deadline = time.monotonic() + WAIT_S
        while any(await tier.lookup(keys)):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the reader's tier still finds cleared chunks after {WAIT_S:g} s"
                )
            await anyio.sleep(_POLL_S)

    async def settle(self, held: bool) -> float:
        """After a stall: wait (bounded) until the framework has given the held slots
        back; the late completions it counted."""
        late = f"{LATE_COMPLETIONS}_total"
        if not has_metric(self.registry, QUARANTINED_SLOTS):
            await self.kv.drain()
            return self.metric(late)
        deadline = time.monotonic() + WAIT_S
        while True:
            await self.kv.drain()
            count = self.metric(late)
            back = not metric_value(self.registry, QUARANTINED_SLOTS)
            if (back and (count >= 1 or not held)) or time.monotonic() > deadline:
                return count
            await anyio.sleep(_POLL_S)


@dataclass(eq=False, repr=False)
class Nodes:
    """The writer and reader of one test, and every chunk stored through them."""

    writer: Node
    reader: Node
    #: Fresh chunk contents come from it: a test's own seed.
    generator: torch.Generator
    #: Seconds a lookup waits for the tier's promotions.
    lookup_timeout_s: float
    #: Chunk contents by key, as stored.
    stored: dict[OffloadKey, torch.Tensor] = field(default_factory=dict)

    @property
    def shared(self) -> bool:
        return self.reader is self.writer

    async def put(
        self,
        node: Node,
        keys: Sequence[OffloadKey],
        *,
        drain: bool = True,
        room_wait_s: float | None = None,
    ) -> list[OffloadKey]:
        """Store ``keys`` (fresh random contents) through ``node``; the keys stored.

        With ``drain``, a primary tier's worth at a time, each drained, so that every
        key reaches the tier; otherwise one key per call, each waiting for room at most
        ``room_wait_s`` seconds, and nothing is drained.
        """
        size = node.primary_chunks if drain else 1
        stored: list[OffloadKey] = []
        for start in range(0, len(keys), size):
            part = list(keys[start : start + size])
            blocks = node.blocks(len(part))
            shape = (len(part), node.cache.shape[1])
            contents = torch.randint(0, 256, shape, dtype=torch.uint8, generator=self.generator)
            node.cache[blocks] = contents
            req = f"store-{uuid.uuid4().hex}"
            count = await node.kv.store(part, blocks, req, timeout=room_wait_s)
            node.kv.finish(req)
            if drain:
                assert count == len(part), f"stored {count} of {len(part)} chunks"
                await node.kv.drain()
            if count:
                self.stored.update(zip(part, contents, strict=True))
                stored.extend(part)
        return stored

    async def read_back(self, node: Node, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Look each key up and load it; check every byte; the keys found.

        A key found must hold exactly what was stored under it; a miss is no fault.
        """
        found: list[OffloadKey] = []
        for key in keys:
            req = f"read-{uuid.uuid4().hex}"
            hits = await node.kv.lookup([key], req, timeout=self.lookup_timeout_s)
            if hits:
                [block] = node.blocks(1)
                node.cache[block] = 0
                loaded = await node.kv.load([key], [block], req)
                if loaded:
                    self.check(key, node.cache[block])
                    found.append(key)
            node.kv.finish(req)
        return found

    async def load_all(self, node: Node, keys: Sequence[OffloadKey]) -> None:
        """Look ``keys`` up and load them, half a primary tier at a time: every one
        must be found and byte-exact."""
        size = max(1, node.primary_chunks // 2)
        for start in range(0, len(keys), size):
            part = list(keys[start : start + size])
            req = f"load-{uuid.uuid4().hex}"
            hits = await node.kv.lookup(part, req, timeout=self.lookup_timeout_s)
            assert hits == len(part), f"found {hits} of {len(part)} stored chunks"
            blocks = node.blocks(len(part))
            node.cache[blocks] = 0
            assert await node.kv.load(part, blocks, req) == len(part)
            node.kv.finish(req)
            for key, block in zip(part, blocks, strict=True):
                self.check(key, node.cache[block])

    def check(self, key: OffloadKey, got: torch.Tensor) -> None:
        """``got`` is exactly what was stored under ``key``, or the failure says whose
        bytes it holds instead."""
        expected = self.stored[key]
        if torch.equal(got, expected):
            return
        others = [other for other, data in self.stored.items() if torch.equal(got, data)]
        if others:
            raise AssertionError(
                f"chunk {key.hex()[:16]} came back holding the bytes of chunk "
                f"{others[0].hex()[:16]}: a slot was reused while a timed-out job still used it"
            )
        differ = int((got != expected).sum())
        raise AssertionError(f"chunk {key.hex()[:16]} came back with {differ} bytes changed")

    async def empty_primary(self) -> None:
        """Make the reader find chunks only in the tier."""
        if self.shared:
            await self.reader.kv.reset()

    async def check_fresh(self, node: Node, fresh: Sequence[OffloadKey]) -> None:
        """The chunks stored while a stalled job held its slot come back byte-exact,
        from the primary tier and then from the tier."""
        assert fresh, "no chunk could be stored while a stalled job held its slot"
        assert await self.read_back(node, fresh), "no fresh chunk was found"
        await node.kv.reset()
        await self.read_back(node, fresh)
