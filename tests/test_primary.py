"""The primary tier's bookkeeping: slots, ref counts, events."""

from __future__ import annotations

import pytest
from helpers import keys

from kvtier import CachePolicy, CachePolicyFactory, LookupResult, Medium
from kvtier.errors import StateError
from kvtier.policies import LRUCachePolicy
from kvtier.primary import PrimaryTier


def tier(capacity: int = 4, events: bool = True) -> PrimaryTier:
    return PrimaryTier(capacity, CachePolicyFactory.create("lru", capacity), enable_events=events)


def stored(primary: PrimaryTier, ks) -> list[int]:
    out = primary.prepare_store(ks)
    assert out is not None
    primary.complete_store(ks)
    return list(out.store_spec.chunk_ids)


def test_a_key_is_pending_while_written_then_a_hit():
    primary = tier()
    [key] = keys("a", 1)
    assert primary.lookup(key) is LookupResult.MISS
    primary.prepare_store([key])
    assert primary.lookup(key) is LookupResult.HIT_PENDING
    primary.complete_store([key])
    assert primary.lookup(key) is LookupResult.HIT


def test_prepare_store_returns_only_new_keys_with_their_slots():
    primary = tier()
    a, b, c = keys("k", 3)
    stored(primary, [a])
    out = primary.prepare_store([a, b, c])
    assert out is not None
    assert out.keys_to_store == [b, c]
    assert len(out.store_spec.chunk_ids) == 2
    assert primary.slot_of(b) == out.store_spec.chunk_ids[0]


def test_eviction_never_takes_the_keys_of_the_call():
    primary = tier(capacity=2)
    a, b, c = keys("k", 3)
    stored(primary, [a, b])
    out = primary.prepare_store([a, c])  # needs one slot: must take b, not a
    assert out is not None
    assert out.evicted_keys == [b]


def test_prepare_store_changes_nothing_when_pinned_keys_block_it():
    primary = tier(capacity=2)
    a, b, c, d = keys("k", 4)
    stored(primary, [a, b])
    primary.prepare_load([a])
    assert primary.prepare_store([c, d]) is None
    assert set(primary.slots()) == {a, b}
    assert primary.num_evictable == 1


def test_keys_being_written_are_not_evicted():
    primary = tier(capacity=1)
    a, b = keys("k", 2)
    primary.prepare_store([a])
    assert primary.prepare_store([b]) is None


def test_failed_store_frees_the_slot():
    primary = tier(capacity=1)
    a, b = keys("k", 2)
    primary.prepare_store([a])
    primary.complete_store([a], success=False)
    assert primary.lookup(a) is LookupResult.MISS
    assert primary.prepare_store([b]) is not None


def test_pins_count_readers():
    primary = tier()
    [a] = keys("k", 1)
    stored(primary, [a])
    primary.prepare_load([a])
    primary.prepare_load([a])
    assert primary.ref_count(a) == 2
    primary.complete_load([a])
    primary.complete_load([a])
    assert primary.ref_count(a) == 0
    assert primary.num_evictable == 1


def test_loading_a_missing_key_raises_and_pins_nothing():
    primary = tier()
    a, b = keys("k", 2)
    stored(primary, [a])
    with pytest.raises(StateError, match="not stored"):
        primary.prepare_load([a, b])
    assert primary.ref_count(a) == 0


def test_loading_a_key_being_written_raises():
    primary = tier()
    [a] = keys("k", 1)
    primary.prepare_store([a])
    with pytest.raises(StateError, match="still being written"):
        primary.prepare_load([a])


def test_completing_an_unpinned_load_raises():
    primary = tier()
    [a] = keys("k", 1)
    stored(primary, [a])
    with pytest.raises(StateError, match="not pinned"):
        primary.complete_load([a])


def test_secondary_facing_aliases_are_the_same_operations():
    primary = tier()
    [a] = keys("k", 1)
    out = primary.prepare_write([a])
    assert out is not None and out.keys_to_store == [a]
    primary.complete_write([a])
    spec = primary.prepare_read([a])
    assert primary.ref_count(a) == 1
    primary.complete_read([a])
    assert list(spec.chunk_ids) == [primary.slot_of(a)]


def test_removal_events_come_before_the_store_events_that_caused_them():
    primary = tier(capacity=2)
    a, b, c = keys("k", 3)
    stored(primary, [a, b])
    primary.take_events()
    stored(primary, [c])
    events = primary.take_events()
    # The prefix [a, b] loses its tail.
    assert [(e.keys, e.removed) for e in events] == [((b,), True), ((c,), False)]
    assert all(e.medium is Medium.CPU and e.tier == "0:primary" for e in events)
    assert primary.take_events() == []


def test_no_events_are_kept_unless_enabled():
    primary = tier(events=False)
    stored(primary, keys("k", 2))
    assert primary.take_events() == []


def test_reset_forgets_everything_and_reports_removals():
    primary = tier()
    a, b = keys("k", 2)
    stored(primary, [a])
    primary.prepare_store([b])
    primary.take_events()
    primary.reset()
    assert primary.num_stored == 0 and primary.num_free == 4
    assert [(e.keys, e.removed) for e in primary.take_events()] == [((a,), True)]


# ------------------------------------------------------- prefixes under pressure

POLICIES = ["lru", "arc"]


def ranked_tier(policy: str, capacity: int) -> PrimaryTier:
    return PrimaryTier(capacity, CachePolicyFactory.create(policy, capacity))


def store_as(primary: PrimaryTier, ks, owner: str) -> list[bytes]:
    """Store ``ks`` for ``owner``; the keys evicted for them."""
    out = primary.prepare_store(ks, owner=owner)
    assert out is not None
    primary.complete_store(ks)
    return list(out.evicted_keys)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("splits", [[5], [2, 2, 1], [1] * 5], ids=["one", "three", "five"])
def test_a_prefix_loses_its_tail_first_however_many_stores_it_took(policy, splits):
    primary = ranked_tier(policy, 5)
    prefix = keys("a", 5)
    start = 0
    for count in splits:
        store_as(primary, prefix[start : start + count], "A")
        start += count
    assert store_as(primary, keys("b", 2), "B") == [prefix[4], prefix[3]]


@pytest.mark.parametrize("policy", POLICIES)
def test_an_older_requests_prefix_goes_before_a_newer_ones(policy):
    primary = ranked_tier(policy, 6)
    a, b = keys("a", 3), keys("b", 3)
    store_as(primary, a, "A")
    store_as(primary, b, "B")
    assert store_as(primary, keys("c", 4), "C") == [a[2], a[1], a[0], b[2]]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_request_that_loads_a_head_takes_it_into_its_own_prefix(policy):
    # B loads A's first two chunks and stores its own continuation: what is left of A
    # is now the oldest prefix, and B's prefix runs from A's head to its own tail.
    primary = ranked_tier(policy, 7)
    a, b = keys("a", 5), keys("b", 2)
    store_as(primary, a, "A")
    primary.prepare_load(a[:2])
    primary.touch(a[:2], "B")
    primary.complete_load(a[:2])
    store_as(primary, b, "B")
    assert store_as(primary, keys("c", 4), "C") == [a[4], a[3], a[2], b[1]]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_load_of_a_whole_prefix_ranks_it_head_first_whatever_came_back_first(policy):
    # The tail came back from a lower tier for R (a promotion a key), while the head was
    # still there from an older request; R then loads the whole prefix.
    primary = ranked_tier(policy, 6)
    prefix = keys("p", 4)
    store_as(primary, prefix[:2], "older")
    for key in prefix[2:]:
        store_as(primary, [key], "R")
    primary.touch(prefix, "R")
    assert store_as(primary, keys("c", 4), "C") == [prefix[3], prefix[2]]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_pinned_key_is_passed_over_and_keeps_its_rank(policy):
    primary = ranked_tier(policy, 4)
    prefix = keys("a", 4)
    store_as(primary, prefix, "A")
    primary.prepare_load(prefix[3:])  # a cascade reads the tail: no use, only a pin
    assert store_as(primary, keys("b", 1), "B") == [prefix[2]]
    primary.complete_load(prefix[3:])
    assert store_as(primary, keys("c", 1), "C") == [prefix[3]]


def test_a_policy_of_its_own_hears_of_every_use_through_touch():
    # An out-of-tree policy that knows nothing of owners: stores and a request's loads
    # reach it as touches, head first, as before.
    class Recording(LRUCachePolicy):
        follow = CachePolicy.follow  # the interface's default

        def __init__(self, capacity: int) -> None:
            super().__init__(capacity)
            self.touched: list[list[bytes]] = []

        def touch(self, keys) -> None:
            self.touched.append(list(keys))
            LRUCachePolicy.follow(self, keys, object())

    policy = Recording(4)
    primary = PrimaryTier(4, policy)
    a = keys("a", 3)
    store_as(primary, a, "A")
    primary.touch(a[:2], "B")
    assert policy.touched == [a, a[:2]]
