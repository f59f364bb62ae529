"""The owning side, over the in-memory transport: a real tier, a hand-driven reader."""

from __future__ import annotations

import asyncio

import anyio
import pytest
from helpers import keys
from p2p_memory import CHUNK, HANG_S, NAMESPACE, MemoryNode, dial, until

from kvtier.format import HEADER_BYTES, ChunkFormat
from kvtier.tiers.p2p import AUTH_FAILURES, FRAMES_REJECTED, REVERIFIED_CHUNKS, MemoryTransport
from kvtier.tiers.p2p.channel import Channel
from kvtier.tiers.p2p.context import SERVED_CHUNKS
from kvtier.tiers.p2p.errors import PeerClosed, Rejected
from kvtier.tiers.p2p.wire import (
    CHUNK_META,
    Kind,
    chunk_body_bytes,
    decode_key_list,
    encode_fetch,
    encode_key_list,
    read_frame,
    send_frame,
)

pytestmark = pytest.mark.anyio


async def next_frame(channel: Channel) -> tuple[Kind, bytearray]:
    with anyio.fail_after(HANG_S):
        return await read_frame(channel, chunk_body_bytes(CHUNK))


async def test_a_new_reader_first_hears_every_key_the_owner_holds():
    transport = MemoryTransport()
    async with MemoryNode(transport, "owner") as owner:
        held = keys("held", 3)
        await owner.put(held, [0, 1, 2])
        channel, _ = await dial(transport, owner.address)
        kind, body = await next_frame(channel)
        assert kind is Kind.ANNOUNCE and decode_key_list(body) == held
        await until(lambda: owner.tier.inbound_peers == 1)
        channel.close()


async def test_an_eviction_is_withdrawn_from_connected_readers():
    transport = MemoryTransport()
    async with MemoryNode(transport, "owner") as owner:
        held = keys("held", 2)
        await owner.put(held, [0, 1])
        channel, _ = await dial(transport, owner.address)
        await next_frame(channel)
        owner.tier.on_primary_removed(held[:1] + keys("never-held", 1))
        kind, body = await next_frame(channel)
        assert kind is Kind.WITHDRAW and decode_key_list(body) == held[:1]
        channel.close()


async def test_a_fetch_gets_each_held_chunk_verifiable_and_missing_for_the_rest():
    transport = MemoryTransport()
    async with MemoryNode(transport, "owner") as owner:
        held, unknown = keys("held", 2), keys("unknown", 1)
        contents = await owner.put(held, [3, 5])
        channel, _ = await dial(transport, owner.address)
        await next_frame(channel)  # the announcement
        await send_frame(channel, Kind.FETCH, encode_fetch(9, [held[1], *unknown, held[0]]))
        answers = {}
        for _ in range(3):
            kind, body = await next_frame(channel)
            request_id, position = CHUNK_META.unpack_from(body)
            assert request_id == 9
            answers[position] = (kind, bytes(body[CHUNK_META.size :]))
        assert answers[1] == (Kind.MISSING, b"")
        chunk_format = ChunkFormat(NAMESPACE)
        for position, key, data in ((0, held[1], contents[1]), (2, held[0], contents[0])):
            kind, chunk = answers[position]
            header, payload = chunk[:HEADER_BYTES], chunk[HEADER_BYTES:]
            assert kind is Kind.CHUNK and payload == data
            assert chunk_format.verify(header, key, memoryview(payload)) is None
        await until(lambda: owner.manager.pinned == 0)
        assert owner.counter(SERVED_CHUNKS) == 2
        channel.close()


async def test_a_reader_that_sends_anything_but_fetch_is_cut_off_and_counted():
    transport = MemoryTransport()
    async with MemoryNode(transport, "owner") as owner:
        channel, _ = await dial(transport, owner.address)
        await send_frame(channel, Kind.ANNOUNCE, encode_key_list(keys("mine", 1)))
        with anyio.fail_after(HANG_S), pytest.raises(PeerClosed):
            await read_frame(channel, 1 << 20)
        await until(lambda: owner.counter(FRAMES_REJECTED) == 1)
        assert owner.tier.inbound_peers == 0
        # The owner goes on serving others.
        other, _ = await dial(transport, owner.address)
        await until(lambda: owner.tier.inbound_peers == 1)
        other.close()


async def test_a_fetch_for_more_keys_than_allowed_is_cut_off_and_counted():
    transport = MemoryTransport()
    async with MemoryNode(transport, "owner") as owner:
        channel, _ = await dial(transport, owner.address)
        too_many = [b"k%d" % i for i in range(1025)]
        await send_frame(channel, Kind.FETCH, encode_fetch(1, too_many))
        await until(lambda: owner.counter(FRAMES_REJECTED) == 1)
        channel.close()


def verdicts(owner: MemoryNode, verdict: str) -> float:
    labels = {"tier": "owner", "verdict": verdict}
    return owner.metrics.sample(f"{REVERIFIED_CHUNKS}_total", labels) or 0.0


async def test_a_report_of_a_row_that_changed_withdraws_it_and_one_of_an_intact_row_does_not():
    transport = MemoryTransport()
    async with MemoryNode(transport, "owner") as owner:
        held = keys("held", 2)
        await owner.put(held, [0, 1])
        owner.view[1][7] ^= 0x10  # after its checksum was taken
        channel, _ = await dial(transport, owner.address)
        await next_frame(channel)  # the announcement
        report = [held[0], *keys("never-held", 1)]
        await send_frame(channel, Kind.CORRUPT, encode_key_list(report))
        await until(lambda: verdicts(owner, "intact") == 1)
        assert verdicts(owner, "damaged") == 0 and owner.tier.announced_keys == 2
        await send_frame(channel, Kind.CORRUPT, encode_key_list(held[1:]))
        kind, body = await next_frame(channel)
        assert kind is Kind.WITHDRAW and decode_key_list(body) == held[1:]
        assert verdicts(owner, "damaged") == 1 and owner.tier.announced_keys == 1
        await until(lambda: owner.manager.pinned == 0)
        assert owner.counter(FRAMES_REJECTED) == 0
        channel.close()


async def test_a_corrupt_chunk_report_on_a_version_1_connection_is_cut_off_and_counted():
    transport = MemoryTransport()
    async with MemoryNode(transport, "owner") as owner:
        channel, remote = await dial(transport, owner.address, version=1)
        assert remote.version == 1
        await send_frame(channel, Kind.CORRUPT, encode_key_list(keys("any", 1)))
        await until(lambda: owner.counter(FRAMES_REJECTED) == 1)
        assert verdicts(owner, "intact") == verdicts(owner, "damaged") == 0
        channel.close()


async def test_a_reader_with_the_wrong_secret_is_refused_and_counted():
    transport = MemoryTransport()
    async with MemoryNode(transport, "owner") as owner:
        with pytest.raises(Rejected):
            await dial(transport, owner.address, secret="not-the-secret-but-long-enough")
        await until(lambda: owner.counter(AUTH_FAILURES) == 1)
        assert owner.tier.inbound_peers == 0


async def test_connections_beyond_max_inbound_are_closed_on_arrival():
    transport = MemoryTransport()
    async with MemoryNode(transport, "owner", max_inbound_connections=1):
        first = await transport.connect("owner", 7070)  # holds the one place, silent
        second = await transport.connect("owner", 7070)
        with anyio.fail_after(HANG_S):
            assert await second.recv_into(memoryview(bytearray(1))) == 0
        first.close()


async def test_closing_the_tier_ends_every_connection_and_can_be_repeated():
    transport = MemoryTransport()
    before = asyncio.all_tasks()
    owner = MemoryNode(transport, "owner")
    await owner.tier.start()
    channel, _ = await dial(transport, owner.address)
    await until(lambda: owner.tier.inbound_peers == 1)
    await owner.tier.aclose()
    await owner.tier.aclose()
    assert asyncio.all_tasks() - before == set()
    assert owner.tier.inbound_peers == 0
    with anyio.fail_after(HANG_S), pytest.raises(PeerClosed):
        await read_frame(channel, 1 << 20)
    with pytest.raises(ConnectionRefusedError):
        await transport.connect("owner", 7070)
