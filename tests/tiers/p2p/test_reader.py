"""The reading side, over the in-memory transport: real tiers, or a hand-driven owner."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import anyio
import pytest
from helpers import keys
from p2p_memory import CHUNK, HANG_S, NAMESPACE, SECRET, MemoryNode, until

from kvtier._secrets import Secret
from kvtier.format import HEADER_BYTES, ChunkFormat
from kvtier.tiers.p2p import (
    ANNOUNCE_BYTES,
    ANNOUNCE_FRAMES,
    ANNOUNCE_KEYS,
    AUTH_FAILURES,
    FRAMES_REJECTED,
    INDEX_MEMORY,
    SERVED_CHUNKS,
    MemoryTransport,
)
from kvtier.tiers.p2p.channel import Channel, Listener
from kvtier.tiers.p2p.context import INDEXED_KEYS
from kvtier.tiers.p2p.errors import Reject
from kvtier.tiers.p2p.handshake import PROTOCOL_VERSION, Credentials, decode_hello
from kvtier.tiers.p2p.wire import CHUNK_META, Kind, encode_key_list, read_frame, send_frame

pytestmark = pytest.mark.anyio

# Redial at once: the tests that need a redial must not wait for the default backoff.
QUICK = {"reconnect_initial_s": 0.001, "reconnect_max_s": 0.01}


def pair(transport: MemoryTransport, **reader_params):
    """An owner node and a node that reads from it (enter both with ``async with``)."""
    owner = MemoryNode(transport, "owner")
    reader = MemoryNode(transport, "reader", peers=[owner.address], **QUICK, **reader_params)
    return owner, reader


async def test_a_chunk_the_owner_stored_is_loaded_byte_exact_into_the_readers_slot():
    transport = MemoryTransport()
    owner, reader = pair(transport)
    async with owner, reader:
        ks = keys("shared", 3)
        contents = await owner.put(ks, [0, 1, 2])
        await until(lambda: all(reader.tier.contains(k) for k in ks))
        result = await reader.pull(ks, [5, 6, 7])
        assert result.success and list(result.successful_keys or ()) == ks
        assert [bytes(reader.view[slot]) for slot in (5, 6, 7)] == contents
        assert reader.tier.connected_peers == [owner.address]
        assert reader.metrics.sample(INDEXED_KEYS, {"tier": "reader"}) == 3
        await until(lambda: owner.manager.pinned == 0)


async def test_a_key_evicted_by_the_owner_leaves_the_readers_index():
    transport = MemoryTransport()
    owner, reader = pair(transport)
    async with owner, reader:
        ks = keys("gone", 2)
        await owner.put(ks, [0, 1])
        await until(lambda: all(reader.tier.contains(k) for k in ks))
        owner.tier.on_primary_removed(ks[:1])
        await until(lambda: not reader.tier.contains(ks[0]))
        assert reader.tier.contains(ks[1])


def traffic(node: MemoryNode, name: str, flow: str, change: str) -> float:
    labels = {"tier": node.ctx.tier_name, "flow": flow, "change": change}
    return node.metrics.sample(f"{name}_total", labels) or 0.0


async def test_announce_traffic_is_counted_alike_by_the_owner_that_sent_it_and_the_reader():
    transport = MemoryTransport()
    owner, reader = pair(transport)
    async with owner, reader:
        await until(lambda: reader.tier.connected_peers == [owner.address])
        ks = keys("traffic", 3)
        await owner.put(ks, [0, 1, 2])
        await until(lambda: all(reader.tier.contains(k) for k in ks))
        owner.tier.on_primary_removed(ks[:1])
        await until(lambda: not reader.tier.contains(ks[0]))
        # A frame header, a key count, and a length before each key.
        announced = 12 + 4 + sum(2 + len(k) for k in ks)
        withdrawn = 12 + 4 + 2 + len(ks[0])
        for node, flow in ((owner, "sent"), (reader, "received")):
            assert traffic(node, ANNOUNCE_FRAMES, flow, "announce") == 1
            assert traffic(node, ANNOUNCE_KEYS, flow, "announce") == 3
            assert traffic(node, ANNOUNCE_BYTES, flow, "announce") == announced
            assert traffic(node, ANNOUNCE_FRAMES, flow, "withdraw") == 1
            assert traffic(node, ANNOUNCE_KEYS, flow, "withdraw") == 1
            assert traffic(node, ANNOUNCE_BYTES, flow, "withdraw") == withdrawn
        assert traffic(owner, ANNOUNCE_FRAMES, "received", "announce") == 0
        assert traffic(reader, ANNOUNCE_FRAMES, "sent", "announce") == 0
        memory = reader.metrics.sample(INDEX_MEMORY, {"tier": "reader"})
        assert memory is not None and memory >= 2 * (33 + len(ks[1]))  # two keys at least
        assert owner.metrics.sample(INDEX_MEMORY, {"tier": "owner"}) is None  # reads nobody


async def test_a_key_the_owner_no_longer_holds_is_a_miss_and_leaves_the_index():
    transport = MemoryTransport()
    owner, reader = pair(transport)
    async with owner, reader:
        ks = keys("raced", 2)
        await owner.put(ks, [0, 1])
        await until(lambda: all(reader.tier.contains(k) for k in ks))
        del owner.manager.slots[ks[1]]  # evicted, the withdrawal not yet sent
        result = await reader.pull(ks, [4, 5])
        assert not result.success and list(result.successful_keys or ()) == ks[:1]
        assert reader.tier.contains(ks[0]) and not reader.tier.contains(ks[1])
        assert reader.tier.connected_peers == [owner.address]  # a miss is no fault


async def test_a_chunk_changed_after_it_was_stored_fails_verification_and_the_owner_withdraws_it():
    transport = MemoryTransport()
    owner, reader = pair(transport)
    async with owner, reader:
        ks = keys("changed", 1)
        await owner.put(ks, [0])
        owner.view[0][100] ^= 0xFF  # after the checksum was taken
        await until(lambda: reader.tier.contains(ks[0]))
        result = await reader.pull(ks, [3])
        assert not result.success and list(result.successful_keys or ()) == []
        assert reader.ctx.counters.integrity_failures == 1
        # Told of it, the owner found its own row changed and withdrew the key.
        await until(lambda: reader.tier.indexed_keys == 0)
        assert owner.tier.announced_keys == 0
        assert reader.tier.connected_peers == [owner.address]


async def test_a_key_no_peer_announced_is_a_miss_without_any_request():
    transport = MemoryTransport()
    owner, reader = pair(transport)
    async with owner, reader:
        await until(lambda: reader.tier.connected_peers == [owner.address])
        result = await reader.pull(keys("nowhere", 1), [0])
        assert not result.success
        assert owner.counter(SERVED_CHUNKS) == 0


async def test_a_reader_redials_a_restarted_owner_and_hears_its_whole_key_set():
    transport = MemoryTransport()
    owner, reader = pair(transport)
    async with reader:
        async with owner:
            first = keys("first", 2)
            await owner.put(first, [0, 1])
            await until(lambda: all(reader.tier.contains(k) for k in first))
        await until(lambda: reader.tier.indexed_keys == 0)
        assert reader.tier.connected_peers == []
        async with MemoryNode(transport, "owner") as again:
            second = keys("second", 2)
            await again.put(second, [2, 3])
            await until(lambda: all(reader.tier.contains(k) for k in second))
            assert not any(reader.tier.contains(k) for k in first)
            assert reader.tier.connected_peers == [again.address]


async def test_a_node_listed_among_its_own_peers_gives_up_dialing_itself(caplog):
    transport = MemoryTransport()
    caplog.set_level(logging.INFO, logger="kvtier.tiers.p2p")
    async with MemoryNode(transport, "self", peers=["self:7070"], **QUICK) as node:
        await until(
            lambda: not any(t.get_name() == "p2p-dial-self:7070" for t in asyncio.all_tasks())
        )
        assert node.counter(AUTH_FAILURES) == 0
        assert node.tier.connected_peers == [] and node.tier.inbound_peers == 0
        assert "peer self:7070 is this node itself" in caplog.text


# ------------------------------------------------------- a hand-driven owner


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def accept_reader(listener: Listener) -> Channel:
    """Accept one reader and pass the handshake as an owner with the right secret."""
    credentials = Credentials(
        Secret(SECRET.encode()), os.urandom(16), ChunkFormat(NAMESPACE).digest
    )
    with anyio.fail_after(HANG_S):
        channel, _ = await credentials.as_owner(await listener.accept())
    return channel


async def test_an_answer_to_nothing_the_reader_asked_ends_the_link_and_is_counted():
    transport = MemoryTransport()
    listener = await transport.listen("impostor", 7070, backlog=4)
    async with MemoryNode(transport, "reader", peers=["impostor:7070"], **QUICK) as reader:
        channel = await accept_reader(listener)
        ks = keys("bait", 1)
        await send_frame(channel, Kind.ANNOUNCE, encode_key_list(ks))
        await until(lambda: reader.tier.contains(ks[0]))
        await send_frame(channel, Kind.MISSING, CHUNK_META.pack(77, 0))
        await until(lambda: reader.counter(FRAMES_REJECTED) == 1)
        await until(lambda: not reader.tier.contains(ks[0]))
        channel.close()
        await accept_reader(listener)  # the reader comes back
    listener.close()


async def test_a_reader_refused_for_its_version_dials_again_at_version_1_and_reports_nothing():
    """An owner of the first release: it refuses version 2, then knows no CORRUPT frame."""
    transport = MemoryTransport()
    listener = await transport.listen("old", 7070, backlog=4)
    clock = Clock()
    params = {"retry_corrupt_after_s": 1, **QUICK}
    async with MemoryNode(transport, "reader", peers=["old:7070"], clock=clock, **params) as reader:
        with anyio.fail_after(HANG_S):
            refused = await listener.accept()
            kind, body = await read_frame(refused, 256)
            assert kind is Kind.HELLO and decode_hello(body).version == PROTOCOL_VERSION
            await send_frame(refused, Kind.REJECT, bytes([Reject.VERSION]))
            refused.close()
            credentials = Credentials(
                Secret(SECRET.encode()), os.urandom(16), ChunkFormat(NAMESPACE).digest
            )
            channel, remote = await credentials.as_owner(await listener.accept())
        assert remote.version == 1
        ks = keys("old", 1)
        await send_frame(channel, Kind.ANNOUNCE, encode_key_list(ks))
        await until(lambda: reader.tier.contains(ks[0]))
        for _ in range(2):
            pulled = asyncio.ensure_future(reader.pull(ks, [2]))
            kind, body = await read_frame(channel, 1 << 16)  # never a CORRUPT frame
            assert kind is Kind.FETCH
            request_id = int.from_bytes(body[:4], "big")
            payload = bytearray(os.urandom(CHUNK))
            header = ChunkFormat(NAMESPACE).header(ks[0], memoryview(payload))
            payload[0] ^= 1
            meta = CHUNK_META.pack(request_id, 0)
            await send_frame(channel, Kind.CHUNK, meta + bytes(header) + bytes(payload))
            with anyio.fail_after(HANG_S):
                assert not (await pulled).success
            assert not reader.tier.contains(ks[0]) and reader.tier.indexed_keys == 1
            clock.now += 2
        assert reader.ctx.counters.integrity_failures == 2
        assert reader.counter(AUTH_FAILURES) == 0  # an older owner is no failure
        assert reader.tier.connected_peers == ["old:7070"]
        channel.close()
    listener.close()


async def test_a_load_stopped_by_the_framework_leaves_nothing_written_afterwards():
    """A cancelled load aborts the link, so a late chunk never lands in a reused slot."""
    transport = MemoryTransport()
    listener = await transport.listen("slow", 7070, backlog=4)
    async with MemoryNode(transport, "reader", peers=["slow:7070"], **QUICK) as reader:
        channel = await accept_reader(listener)
        ks = keys("slow", 1)
        await send_frame(channel, Kind.ANNOUNCE, encode_key_list(ks))
        await until(lambda: reader.tier.contains(ks[0]))
        with anyio.move_on_after(0.05):
            await reader.pull(ks, [2])  # the owner never answers
        assert not reader.tier.contains(ks[0])  # the link was aborted
        kind, body = await read_frame(channel, 1 << 16)
        assert kind is Kind.FETCH
        request_id = int.from_bytes(body[:4], "big")
        late = CHUNK_META.pack(request_id, 0) + bytes(HEADER_BYTES) + b"\xff" * CHUNK
        with contextlib.suppress(OSError):  # the reader may have hung up already
            await send_frame(channel, Kind.CHUNK, late)
        await accept_reader(listener)  # the reader gave that link up and dialed again
        assert bytes(reader.view[2]) == bytes(CHUNK)
    listener.close()
