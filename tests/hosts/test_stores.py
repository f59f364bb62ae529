"""StoreRoom: keys go into the primary tier in batches, waiting for room only while
something may make some."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import keys, make_config

from kvtier import OffloadingSpecFactory, ReqContext
from kvtier.hosts import Requests, StoreRoom

pytestmark = pytest.mark.timeout(60)

#: A deadline no test reaches: a store that waited for it would fail by the timeout.
FAR = 3600.0


@pytest.fixture
def manager(engine_id):
    spec = OffloadingSpecFactory.create_spec(make_config(engine_id, cpu_bytes_to_use=4 * 4096))
    yield spec.get_manager()
    spec.shutdown()


def pin_everything(manager, req):
    ks = keys("pinned", manager.host.num_chunks)
    out = manager.prepare_store(ks, req)
    manager.complete_store(out.keys_to_store, req)
    manager.prepare_load(ks, req)
    return ks


def test_batches_are_at_most_half_the_primary_tier(manager):
    room = StoreRoom(manager, Requests(manager), in_flight=lambda: False)
    assert room.parts(5) == [range(0, 2), range(2, 4), range(4, 5)]


def test_every_batch_is_copied_then_completed(manager):
    room = StoreRoom(manager, Requests(manager), in_flight=lambda: False)
    copied = []
    ks = keys("new", 3)
    stored = room.store_blocking(
        ks,
        ReqContext("w"),
        lambda out, part: copied.append(list(part)),
        deadline=time.monotonic() + FAR,
    )
    assert (stored.keys, stored.written) == (3, 3)
    assert copied == [[0, 1], [2]]
    assert manager.host.readable_prefix(ks) == 3


def test_with_nothing_that_could_free_a_slot_storing_stops_at_once(manager):
    pin_everything(manager, ReqContext("reader"))
    room = StoreRoom(manager, Requests(manager), in_flight=lambda: False)
    stored = room.store_blocking(
        keys("late", 1), ReqContext("w"), lambda out, part: None, deadline=time.monotonic() + FAR
    )
    assert (stored.keys, stored.written) == (0, 0)


def test_a_store_waits_for_the_slots_another_call_lets_go_of(manager):
    reader = ReqContext("reader")
    pinned = pin_everything(manager, reader)
    room = StoreRoom(manager, Requests(manager), in_flight=lambda: True)
    release = threading.Timer(0.05, manager.complete_load, (pinned, reader))
    release.start()
    stored = room.store_blocking(
        keys("later", 2), ReqContext("w"), lambda out, part: None, deadline=time.monotonic() + FAR
    )
    release.join()
    assert stored.written == 2


def test_a_copy_that_fails_frees_its_slots(manager):
    room = StoreRoom(manager, Requests(manager), in_flight=lambda: False)
    ks = keys("failing", 2)

    def fail(out, part):
        raise OSError("the caller's memory went away")

    with pytest.raises(OSError, match="went away"):
        room.store_blocking(ks, ReqContext("w"), fail, deadline=time.monotonic() + FAR)
    assert manager.host.readable_prefix(ks) == 0
    assert manager.primary.num_busy == 0
