"""The peer index (what peers announced) and the announcer (what this node announces)."""

from __future__ import annotations

import asyncio
import gc
import sys
import tracemalloc
from dataclasses import dataclass

import anyio
import pytest
from helpers import keys

from kvtier.tiers.p2p.errors import LinkError
from kvtier.tiers.p2p.index import Announcer, Outbox, PeerIndex
from kvtier.tiers.p2p.wire import decode_key_list, encode_key_list

HANG_S = 10


@dataclass(eq=False)
class Peer:
    """A holder: a connection that is live or not, with requests in flight."""

    name: str
    live: bool = True
    in_flight: int = 0


# ---------------------------------------------------------------- peer index


def test_a_key_a_live_peer_announced_is_in_the_index():
    index: PeerIndex[Peer] = PeerIndex()
    a = Peer("a")
    index.add(a, keys("k", 2))
    assert all(index.contains(k) for k in keys("k", 2))
    assert not index.contains(keys("other", 1)[0])
    assert len(index) == 2


def test_the_keys_of_a_dead_peer_are_ignored_before_they_are_dropped():
    index: PeerIndex[Peer] = PeerIndex()
    a = Peer("a")
    index.add(a, keys("k", 1))
    a.live = False
    assert not index.contains(keys("k", 1)[0])
    assert index.pick(keys("k", 1)[0]) is None


def test_a_withdrawn_key_leaves_the_index_only_for_the_peer_that_withdrew_it():
    index: PeerIndex[Peer] = PeerIndex()
    a, b = Peer("a"), Peer("b")
    shared, only_a = keys("shared", 1)[0], keys("a", 1)[0]
    index.add(a, [shared, only_a])
    index.add(b, [shared])
    index.remove(a, [shared, only_a])
    assert index.contains(shared) and not index.contains(only_a)
    assert index.pick(shared) is b
    index.remove(b, [shared])
    assert len(index) == 0


def test_announcing_a_key_twice_lists_its_holder_once():
    index: PeerIndex[Peer] = PeerIndex()
    a = Peer("a")
    key = keys("k", 1)[0]
    index.add(a, [key])
    index.add(a, [key])
    index.remove(a, [key])
    assert not index.contains(key)


def test_a_load_picks_the_live_holder_with_the_fewest_requests_in_flight():
    index: PeerIndex[Peer] = PeerIndex()
    busy, idle, dead = Peer("busy", in_flight=3), Peer("idle", in_flight=1), Peer("dead")
    dead.live = False
    key = keys("k", 1)[0]
    for peer in (busy, dead, idle):
        index.add(peer, [key])
    assert index.pick(key) is idle


@pytest.mark.anyio
async def test_dropping_a_peer_forgets_all_its_keys_and_keeps_the_others():
    index: PeerIndex[Peer] = PeerIndex()
    gone, stays = Peer("gone"), Peer("stays")
    many = keys("many", 20_000)  # more than one slice of the drop
    index.add(gone, many)
    index.add(stays, many[:3])
    gone.live = False
    await index.drop(gone)
    assert len(index) == 3
    assert all(index.pick(k) is stays for k in many[:3])
    index.add(gone, many[-1:])  # a holder dropped and heard from again starts afresh
    assert len(index) == 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_backed_off_copy_is_skipped_for_a_doubling_wait_capped_and_ended_by_a_good_transfer():
    clock = Clock()
    index: PeerIndex[Peer] = PeerIndex(retry_after_s=1, retry_max_s=3, clock=clock)
    a = Peer("a")
    key = keys("k", 1)[0]
    index.add(a, [key])
    assert [index.back_off(a, key) for _ in range(4)] == [1, 2, 3, 3]
    assert not index.contains(key) and index.pick(key) is None
    clock.now = 2.9
    assert not index.contains(key)
    clock.now = 3.0
    assert index.contains(key) and index.pick(key) is a
    assert index.recovered(a, key) and not index.recovered(a, key)
    assert index.back_off(a, key) == 1  # counting again from the start
    assert index.backed_off == 1


def test_a_backed_off_copy_leaves_the_other_holders_of_the_key_in_use():
    index: PeerIndex[Peer] = PeerIndex(clock=Clock())
    a, b = Peer("a"), Peer("b")
    key = keys("k", 1)[0]
    index.add(a, [key])
    index.add(b, [key])
    index.back_off(a, key)
    assert index.contains(key) and index.pick(key) is b


@pytest.mark.anyio
async def test_a_key_that_leaves_the_index_takes_its_back_off_along():
    index: PeerIndex[Peer] = PeerIndex(clock=Clock())
    a, b = Peer("a"), Peer("b")
    ks = keys("k", 2)
    index.add(a, ks)
    index.add(b, ks)
    for key in ks:
        index.back_off(a, key)
        index.back_off(b, key)
    index.remove(a, ks[:1])
    await index.drop(b)
    assert index.backed_off == 1
    index.back_off(b, ks[0])  # a holder that no longer announces the key
    assert index.backed_off == 1


def received(prefix: str, count: int) -> list:
    """Keys as a link decodes them off the wire: objects of their own."""
    return decode_key_list(encode_key_list(keys(prefix, count)))


def test_the_index_memory_estimate_is_within_a_quarter_of_what_tracemalloc_sees():
    index: PeerIndex[Peer] = PeerIndex()
    a, b = Peer("a"), Peer("b")
    empty = index.memory_bytes()
    wire_a, wire_b = received("mem", 20_000), received("mem", 5_000)
    # The key objects exist before the measurement begins: added to it by hand.
    key_bytes = sum(sys.getsizeof(key) for key in (*wire_a, *wire_b))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index.add(a, wire_a)
        index.add(b, wire_b)  # a quarter of the keys held by both
        del wire_a, wire_b  # only the index keeps them now
        gc.collect()
        truth = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    truth += key_bytes
    estimate = index.memory_bytes() - empty
    assert 0.75 * truth <= estimate <= 1.25 * truth, (estimate, truth)


@pytest.mark.anyio
async def test_the_index_memory_estimate_gives_back_every_key_that_leaves():
    index: PeerIndex[Peer] = PeerIndex()
    a, b = Peer("a"), Peer("b")
    wire_a, wire_b = received("gone", 300), received("gone", 100)
    key_bytes = sum(sys.getsizeof(key) for key in (*wire_a, *wire_b))
    index.add(a, wire_a)
    index.add(b, wire_b)
    full = index.memory_bytes()
    index.remove(a, keys("gone", 300))
    await index.drop(b)
    # The tables keep the size they grew to, as dicts do; the keys and tuples are gone.
    assert full - index.memory_bytes() >= key_bytes + 300 * sys.getsizeof((a,))


# ----------------------------------------------------------------- announcer


def test_announcing_reports_only_keys_not_already_held():
    announcer = Announcer()
    ks = keys("k", 3)
    assert announcer.announce(ks[:2], [1, 2]) == ks[:2]
    assert announcer.announce(ks, [1, 2, 3]) == ks[2:]
    assert len(announcer) == 3
    assert announcer.checksum(ks[2]) == 3


def test_withdrawing_reports_only_keys_that_were_held():
    announcer = Announcer()
    ks = keys("k", 3)
    announcer.announce(ks[:2], [1, 2])
    assert announcer.withdraw(ks) == ks[:2]
    assert len(announcer) == 0 and announcer.checksum(ks[0]) is None


@pytest.mark.anyio
async def test_a_new_reader_hears_every_held_key_then_each_change_in_order():
    announcer = Announcer()
    a, b, c = keys("a", 2), keys("b", 2), keys("c", 1)
    announcer.announce(a, [0, 0])
    outbox = Outbox(asyncio.Event())
    announcer.subscribe(outbox)
    announcer.announce(b, [0, 0])
    announcer.withdraw(a[:1])
    announcer.withdraw(c)  # never held: no change
    announcer.announce(c, [0])
    # Consecutive changes of one kind are merged; the order between kinds is kept.
    assert announcer.take(outbox) == [(True, a + b), (False, a[:1]), (True, c)]
    assert announcer.take(outbox) == []


@pytest.mark.anyio
async def test_a_reader_that_unsubscribed_hears_nothing_more():
    announcer = Announcer()
    outbox = Outbox(asyncio.Event())
    announcer.subscribe(outbox)
    announcer.unsubscribe(outbox)
    announcer.announce(keys("k", 1), [0])
    assert announcer.take(outbox) == []


@pytest.mark.anyio
async def test_a_reader_too_far_behind_is_cut_off():
    announcer = Announcer()
    outbox = Outbox(asyncio.Event(), max_backlog=3)
    announcer.announce(keys("initial", 10), [0] * 10)
    announcer.subscribe(outbox)  # the initial key set does not count
    announcer.announce(keys("k", 2), [0, 0])
    announcer.withdraw(keys("k", 2))
    with pytest.raises(LinkError, match="more than 3 index changes behind"):
        announcer.take(outbox)


@pytest.mark.anyio
async def test_a_change_on_the_loop_wakes_the_reader_at_once():
    wake = asyncio.Event()
    announcer = Announcer()
    announcer.subscribe(Outbox(wake))
    announcer.announce(keys("k", 1), [0])
    assert wake.is_set()


@pytest.mark.anyio
async def test_a_withdrawal_from_the_schedulers_thread_wakes_the_reader_on_the_loop():
    wake = asyncio.Event()
    announcer = Announcer()
    announcer.announce(keys("k", 1), [0])
    outbox = Outbox(wake)
    announcer.subscribe(outbox)
    announcer.take(outbox)
    wake.clear()
    await asyncio.to_thread(announcer.withdraw, keys("k", 1))
    with anyio.fail_after(HANG_S):
        await wake.wait()
    assert announcer.take(outbox) == [(False, keys("k", 1))]
