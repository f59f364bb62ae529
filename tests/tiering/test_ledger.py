"""The slot ledger: every holder of a primary slot by name, and when a slot is reused."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from helpers import keys

from kvtier import CachePolicyFactory
from kvtier.errors import StateError
from kvtier.primary import PrimaryTier
from kvtier.region import SharedOffloadRegion
from kvtier.tiering.ledger import Holder, SlotLedger

SLOTS = 4


@pytest.fixture
def region(engine_id: str) -> Iterator[SharedOffloadRegion]:
    with SharedOffloadRegion(
        engine_id, num_chunks=SLOTS, chunk_bytes=4096, column_bytes=4096, world_size=1, rank=None
    ) as opened:
        yield opened


@pytest.fixture
def primary() -> PrimaryTier:
    return PrimaryTier(SLOTS, CachePolicyFactory.create("lru", SLOTS))


@pytest.fixture
def ledger(primary: PrimaryTier, region: SharedOffloadRegion) -> SlotLedger:
    return SlotLedger(primary, region.primary_view)


def stored(primary: PrimaryTier, ks) -> list[int]:
    out = primary.prepare_store(ks)
    assert out is not None
    primary.complete_store(ks)
    return list(out.store_spec.chunk_ids)


def test_a_reserved_key_is_taken_over_by_its_request_without_a_second_pin(primary, ledger):
    [key] = keys("promoted", 1)
    stored(primary, [key])
    ledger.pin([key], Holder.reserved("r"))
    ledger.pin_for_request([key], "r")
    assert primary.ref_count(key) == 1
    ledger.release([key], Holder.request("r"))
    assert primary.ref_count(key) == 0
    assert not ledger.held(Holder.reserved("r"))


def test_releasing_a_pin_the_holder_does_not_have_is_refused_and_changes_nothing(primary, ledger):
    a, b = keys("k", 2)
    stored(primary, [a, b])
    ledger.pin([a, b], Holder.request("owner"))
    with pytest.raises(StateError, match="request 'other' holds no pin"):
        ledger.release([a], Holder.request("other"))
    with pytest.raises(StateError, match="holds no pin"):
        ledger.release([a, a], Holder.request("owner"))
    assert primary.ref_count(a) == primary.ref_count(b) == 1
    ledger.release([], Holder.request("nobody"))  # nothing to release is no error


def test_a_timed_out_promotion_keeps_its_slot_until_no_row_of_it_is_referenced(
    primary, ledger, region
):
    [key] = keys("late", 1)
    out = primary.prepare_write([key])
    assert out is not None
    [slot] = out.store_spec.chunk_ids
    row = region.primary_view[slot]  # what a tier's thread would still write through
    view = row[8:16]  # a slice keeps the row referenced too
    del row
    free_before = primary.num_free
    ledger.io_gave_up(7, [key])
    assert primary.slot_of(key) is None  # the key is a miss at once
    assert ledger.io_ended(7)  # its coroutine returned, but a thread still holds the row
    assert primary.num_free == free_before and ledger.quarantined == 1
    del view
    assert not ledger.settle()
    assert primary.num_free == free_before + 1 and ledger.quarantined == 0


def test_a_late_cascade_keeps_its_key_pinned_until_its_thread_lets_go(primary, ledger, region):
    [key] = keys("cascade", 1)
    [slot] = stored(primary, [key])
    ledger.pin([key], Holder.job(3))
    reading = threading.Event()
    release = threading.Event()

    def thread_reads(row: memoryview) -> None:
        reading.set()
        release.wait(10)
        bytes(row)

    thread = threading.Thread(target=thread_reads, args=(region.primary_view[slot],))
    thread.start()
    reading.wait(10)
    ledger.io_gave_up(3, ())
    assert ledger.io_ended(3)
    assert primary.ref_count(key) == 1 and ledger.quarantined == 1
    release.set()
    thread.join()
    assert not ledger.settle()
    assert primary.ref_count(key) == 0 and ledger.quarantined == 0


def test_a_reset_keeps_slots_of_late_io_and_host_copies_until_both_let_go(primary, ledger, region):
    a, b = keys("busy", 2)
    [slot_a, _] = stored(primary, [a, b])
    ledger.pin([a], Holder.job(1))
    row = region.primary_view[slot_a]
    ledger.io_gave_up(1, ())
    ledger.pin([b], Holder.request("copying"))  # a host copy reads it
    ledger.reset(hold_host_copies=True)
    assert primary.num_stored == 0
    assert primary.num_free == SLOTS - 2 and ledger.quarantined == 2
    ledger.release_host_copies()
    assert primary.num_free == SLOTS - 1  # slot_b back; slot_a still has late I/O
    del row
    ledger.settle()
    assert primary.num_free == SLOTS and ledger.quarantined == 0
