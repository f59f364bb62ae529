"""Requests: one record per host request, from its first call to its one end."""

from __future__ import annotations

import pytest
from helpers import keys, make_config

from kvtier import OffloadingSpecFactory, ReqContext
from kvtier.hosts import Requests


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def manager(engine_id):
    spec = OffloadingSpecFactory.create_spec(make_config(engine_id))
    yield spec.get_manager()
    spec.shutdown()


def stored(manager, ks):
    req = ReqContext("writer")
    out = manager.prepare_store(ks, req)
    manager.complete_store(out.keys_to_store, req)
    return ks


def test_ending_a_request_releases_its_claims_and_its_pins(manager):
    requests = Requests(manager)
    request = requests.of("r")
    [key] = stored(manager, keys("pinned", 1))
    manager.prepare_load([key], request.req)
    assert requests.claim(request, keys("computed", 2)) == 2
    claim = requests.claimant(keys("computed", 1)[0])
    requests.end("r")
    assert request.ended
    assert claim is not None and claim.done.is_set()
    assert requests.claimant(keys("computed", 1)[0]) is None
    assert manager.host.held(request.req) == {}
    assert requests.get("r") is None


def test_a_key_claimed_by_one_request_stays_its_own(manager):
    requests = Requests(manager)
    first, second = requests.of("first"), requests.of("second")
    ks = keys("shared", 2)
    assert requests.claim(first, ks[:1]) == 1
    assert requests.claim(second, ks) == 1
    assert requests.claimant(ks[0]).owner == "first"
    assert requests.claimant(ks[1]).owner == "second"


def test_an_ended_request_claims_nothing(manager):
    requests = Requests(manager)
    request = requests.of("done")
    requests.end("done")
    assert requests.claim(request, keys("late", 1)) == 0


def test_new_requests_are_named_by_the_hosts_prefix(manager):
    requests = Requests(manager, prefix="engine")
    assert [requests.new().req_id for _ in range(2)] == ["engine-0", "engine-1"]


def test_kept_keys_go_to_one_later_call_at_a_time(manager):
    requests = Requests(manager)
    request = requests.new()
    ks = keys("kept", 3)
    requests.keep(request, ks, lease_s=60)
    assert requests.resume(ks[0]) is request
    assert requests.resume(ks[0]) is None  # busy with the first call
    requests.done_with(request, ks[:2])
    assert not request.ended and request.kept == {ks[2]}
    assert requests.resume(ks[0]) is None  # that key was taken
    assert requests.resume(ks[2]) is request
    requests.done_with(request, ks[2:])
    assert request.ended
    assert not requests.keeping


def test_a_lease_that_runs_out_ends_its_request(manager):
    clock = Clock()
    requests = Requests(manager, clock=clock)
    idle, busy = requests.new(), requests.new()
    requests.keep(idle, keys("idle", 1), lease_s=5)
    requests.keep(busy, keys("busy", 1), lease_s=10)
    assert requests.next_lapse_s() == 5
    clock.now += 20
    assert requests.resume(keys("busy", 1)[0]) is busy
    requests.expire()
    assert idle.ended
    assert not busy.ended  # a call is using it: that call ends it
    assert requests.next_lapse_s() is None


def test_a_short_lease_kept_after_a_long_one_ends_when_it_runs_out(manager):
    clock = Clock()
    requests = Requests(manager, clock=clock)
    long_, short = requests.new(), requests.new()
    requests.keep(long_, keys("long", 1), lease_s=60)
    requests.keep(short, keys("short", 1), lease_s=5)
    clock.now += 10
    assert requests.next_lapse_s() == 0
    requests.expire()
    assert short.ended
    assert not long_.ended
    assert requests.next_lapse_s() == 50


def test_ending_every_request_ends_those_on_lease_too(manager):
    requests = Requests(manager)
    open_, kept = requests.of("open"), requests.new()
    requests.keep(kept, keys("kept", 1), lease_s=60)
    requests.end_all()
    assert open_.ended and kept.ended
    assert not requests.keeping
