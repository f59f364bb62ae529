"""The primary tier's bookkeeping: slots, ref counts, events."""

from __future__ import annotations

import pytest
from helpers import keys

from kvtier import CachePolicyFactory, LookupResult, Medium
from kvtier.errors import StateError
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
    assert [(e.keys, e.removed) for e in events] == [((a,), True), ((c,), False)]
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
