"""A synchronous host: the manager runs its own loop thread and never blocks the caller."""

from __future__ import annotations

import threading
import time

from helpers import keys, scripted, tiering_config
from scripted_tier import ScriptedTier

from kvtier import LookupResult, OffloadingSpecFactory, ReqContext

REQ = ReqContext("sync")


def build(engine_id, tiers, **kw):
    spec = OffloadingSpecFactory.create_spec(tiering_config(engine_id, tiers, **kw))
    return spec, spec.get_manager()


def step_until(manager, predicate, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "the manager made no progress"
        manager.on_schedule_end()
        manager.host.wait_for_completions_blocking(0.1)


def store(manager, ks, req=REQ):
    out = manager.prepare_store(ks, req)
    assert out is not None
    manager.complete_store(ks, req)


def test_a_sync_host_gets_a_started_manager_on_its_own_loop_thread(engine_id):
    spec, manager = build(engine_id, [{"type": "example"}])
    try:
        assert manager.owns_loop
        assert any(t.name == "kvtier-tiers" for t in threading.enumerate())
    finally:
        spec.shutdown()
    assert not any(t.name == "kvtier-tiers" and t.is_alive() for t in threading.enumerate())


def test_promotion_round_trip_from_a_sync_host(engine_id):
    spec, manager = build(engine_id, [scripted("sync-rt")], chunks=2)
    try:
        [key] = keys("rt", 1)
        store(manager, [key])
        step_until(manager, lambda: not manager.has_pending_work())
        store(manager, keys("push", 2), ReqContext("push"))
        step_until(manager, lambda: not manager.has_pending_work())
        assert manager.lookup(key, REQ) is LookupResult.RETRY
        step_until(manager, lambda: manager.lookup(key, REQ) is LookupResult.HIT)
    finally:
        spec.shutdown()


def test_scheduler_calls_never_wait_for_a_stuck_tier(engine_id):
    spec, manager = build(engine_id, [scripted("sync-stuck")], chunks=4)
    tier = ScriptedTier.instances["sync-stuck"]
    manager.loop.call(tier.gate.clear)
    try:
        started = time.monotonic()
        refused = 0
        for i in range(20):
            req = ReqContext(f"r{i}")
            out = manager.prepare_store(keys(f"nb{i}", 1), req)
            if out is None:
                refused += 1  # every slot is pinned by a stuck cascade: no room, no wait
            else:
                manager.complete_store(out.keys_to_store, req)
            assert manager.lookup(keys("absent", 1)[0], REQ) is LookupResult.RETRY
            manager.on_schedule_end()
        # Twenty steps against a tier that answers nothing: only in-memory work.
        assert time.monotonic() - started < 5
        assert refused == 16
        assert manager.has_pending_work()
    finally:
        manager.loop.call(tier.gate.set)
        spec.shutdown()


def test_lock_guards_calls_from_several_host_threads(engine_id):
    spec, manager = build(engine_id, [{"type": "example"}], chunks=64)
    ks = keys("threads", 64)
    try:

        def worker(part):
            for key in part:
                with manager.lock:
                    store(manager, [key], ReqContext(key.hex()))

        threads = [threading.Thread(target=worker, args=(ks[i::4],)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with manager.lock:
            step_until(manager, lambda: not manager.has_pending_work())
        tier = manager.tiers[0]
        assert all(tier.contains(key) for key in ks)
    finally:
        spec.shutdown()


def test_reset_cache_waits_for_jobs_in_flight(engine_id):
    spec, manager = build(engine_id, [scripted("sync-reset")], chunks=4)
    tier = ScriptedTier.instances["sync-reset"]
    try:
        manager.loop.call(tier.gate.clear)
        ks = keys("reset", 2)
        store(manager, ks)
        resetter = threading.Thread(target=manager.reset_cache)
        resetter.start()
        resetter.join(0.2)
        assert resetter.is_alive(), "reset_cache returned while a cascade still read its slots"
        manager.loop.call(tier.gate.set)
        resetter.join(30)
        assert not resetter.is_alive()
        assert manager.primary.num_stored == 0
        assert all(key in tier.chunks for key in ks)
    finally:
        spec.shutdown()


def test_shutdown_is_idempotent_and_stops_the_loop_thread(engine_id):
    spec, manager = build(engine_id, [{"type": "example"}])
    store(manager, keys("bye", 2))
    manager.shutdown()
    manager.shutdown()
    spec.shutdown()
    assert manager.region.closed


def test_pins_are_served_while_the_host_is_idle(engine_id):
    import asyncio

    spec, manager = build(engine_id, [scripted("sync-pin")], chunks=4)
    try:
        tier = ScriptedTier.instances["sync-pin"]
        [key] = keys("idle-pin", 1)
        store(manager, [key])
        step_until(manager, lambda: not manager.has_pending_work())
        future = asyncio.run_coroutine_threadsafe(tier.ctx.primary.pin([key]), manager.loop.loop)
        rows = future.result(timeout=10)  # the host makes no call meanwhile
        assert list(rows) == [key]
        tier.ctx.primary.unpin([key])
        step_until(manager, lambda: manager.primary.ref_count(key) == 0)
    finally:
        spec.shutdown()
