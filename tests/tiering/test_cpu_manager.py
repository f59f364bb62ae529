"""The CPU spec's manager: the scheduler-facing interface with no secondary tiers."""

from __future__ import annotations

import threading

import pytest
from helpers import keys, make_config
from prometheus_client import REGISTRY, CollectorRegistry

from kvtier import LookupResult, OffloadingSpecFactory, ReqContext, TieringOffloadingManager

REQ = ReqContext("req-1")


def manager_for(engine_id, registry=None, **extra):
    spec = OffloadingSpecFactory.create_spec(make_config(engine_id, **extra), registry=registry)
    return spec, spec.get_manager()


def store(manager, ks, req=REQ):
    out = manager.prepare_store(ks, req)
    assert out is not None
    manager.complete_store(ks, req)
    return out


def test_cpu_spec_builds_the_tiering_manager_with_no_tiers(engine_id):
    spec, manager = manager_for(engine_id)
    assert isinstance(manager, TieringOffloadingManager)
    assert spec.get_manager() is manager
    assert not manager.has_pending_work()
    spec.shutdown()


def test_store_then_load_walks_miss_pending_hit(engine_id):
    spec, manager = manager_for(engine_id)
    [key] = keys("walk", 1)
    assert manager.lookup(key, REQ) is LookupResult.MISS
    out = manager.prepare_store([key], REQ)
    assert out is not None and out.keys_to_store == [key]
    assert manager.lookup(key, REQ) is LookupResult.HIT_PENDING
    manager.complete_store([key], REQ)
    assert manager.lookup(key, REQ) is LookupResult.HIT
    load = manager.prepare_load([key], REQ)
    assert list(load.chunk_ids) == list(out.store_spec.chunk_ids)
    manager.complete_load([key], REQ)
    spec.shutdown()


def test_prepare_store_returns_none_when_everything_is_pinned(engine_id):
    spec, manager = manager_for(engine_id, cpu_bytes_to_use=2 * 4096)
    a, b, c = keys("pin", 3)
    store(manager, [a, b])
    manager.prepare_load([a, b], REQ)
    assert manager.prepare_store([c], REQ) is None
    manager.complete_load([a, b], REQ)
    assert manager.prepare_store([c], REQ) is not None
    spec.shutdown()


def test_store_threshold_stores_only_chunks_looked_up_often_enough(engine_id):
    registry = CollectorRegistry()
    spec, manager = manager_for(engine_id, registry=registry, store_threshold=2)
    hot, cold = keys("gate", 2)
    for key in (hot, hot, cold):
        manager.lookup(key, REQ)
    out = manager.prepare_store([hot, cold], REQ)
    assert out is not None and out.keys_to_store == [hot]
    manager.complete_store([hot], REQ)
    manager.on_schedule_end()
    assert registry.get_sample_value("kvtier_stores_skipped_total") == 1.0
    spec.shutdown()


def test_stores_skipped_is_only_defined_when_the_gate_is_on(engine_id):
    registry = CollectorRegistry()
    spec, manager = manager_for(engine_id, registry=registry)
    manager.on_schedule_end()
    assert registry.get_sample_value("kvtier_stores_skipped_total") is None
    assert registry.get_sample_value("kvtier_cpu_cache_usage_perc") == 0.0
    spec.shutdown()


def test_metrics_land_on_the_callers_registry_only(engine_id):
    registry = CollectorRegistry()
    spec, manager = manager_for(engine_id, registry=registry, cpu_bytes_to_use=2 * 4096)
    store(manager, keys("m", 2))
    manager.prepare_store(keys("n", 1), REQ)  # evicts one, leaves one being written
    manager.on_schedule_end()
    assert registry.get_sample_value("kvtier_cpu_evictions_total") == 1.0
    assert registry.get_sample_value("kvtier_cpu_cache_usage_perc") == 0.5
    assert registry.get_sample_value("kvtier_cpu_allocation_size_count") == 2.0
    assert REGISTRY.get_sample_value("kvtier_cpu_evictions_total") is None
    spec.shutdown()


def test_max_tracked_lookups_bounds_the_keys_the_store_gate_counts(engine_id):
    spec, manager = manager_for(engine_id, store_threshold=2, max_tracked_lookups=1)
    first, second = keys("tracked", 2)
    # The second key's lookup pushes the first one's count out of the gate's memory.
    for key in (first, second, first):
        manager.lookup(key, REQ)
    out = manager.prepare_store([first], REQ)
    assert out is not None and out.keys_to_store == []
    spec.shutdown()


def test_events_are_recorded_when_enabled(engine_id):
    spec, manager = manager_for(engine_id, enable_kv_events=True, cpu_bytes_to_use=4096)
    a, b = keys("ev", 2)
    store(manager, [a])
    store(manager, [b])
    events = manager.take_events()
    assert [(e.keys, e.removed) for e in events] == [((a,), False), ((a,), True), ((b,), False)]
    spec.shutdown()


def test_reset_cache_forgets_the_primary(engine_id):
    spec, manager = manager_for(engine_id)
    [key] = keys("reset", 1)
    store(manager, [key])
    manager.reset_cache()
    assert manager.lookup(key, REQ) is LookupResult.MISS
    spec.shutdown()


@pytest.mark.anyio
async def test_async_helpers_follow_the_stores_in_flight(engine_id):
    import asyncio

    spec, manager = manager_for(engine_id)
    await manager.drain()  # nothing in flight
    [key] = keys("async", 1)
    out = manager.prepare_store([key], REQ)
    assert out is not None
    waiter = asyncio.ensure_future(manager.wait_for_completions())
    await asyncio.sleep(0)
    assert not waiter.done()
    manager.complete_store([key], REQ)
    await asyncio.wait_for(waiter, 5)
    await manager.aclose()
    await manager.aclose()
    assert manager.region is not None and manager.region.closed
    await spec.aclose()


def test_request_lifecycle_calls_are_accepted_in_any_order(engine_id):
    spec, manager = manager_for(engine_id)
    req = ReqContext("req-2")
    manager.on_new_request(req)
    ks = keys("life", 2)
    out = manager.prepare_store(ks, req)
    assert out is not None
    manager.on_request_finished(req)  # finished while its store is still pending
    manager.complete_store(ks, req)
    assert manager.lookup(ks[0], req) is LookupResult.HIT
    spec.shutdown()


def test_lock_serialises_calls_from_other_threads(engine_id):
    spec, manager = manager_for(engine_id, cpu_bytes_to_use=4096 * 64)
    ks = keys("thread", 64)

    def store_half(part):
        for key in part:
            with manager.lock:
                store(manager, [key], ReqContext(f"t-{key.hex()}"))

    threads = [threading.Thread(target=store_half, args=(ks[i::2],)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(manager.lookup(key, REQ) is LookupResult.HIT for key in ks)
    spec.shutdown()


def test_shutdown_is_idempotent_and_releases_the_region(engine_id):
    spec, manager = manager_for(engine_id)
    region = manager.region
    spec.shutdown()
    spec.shutdown()
    assert region is not None and region.closed


def test_a_reset_holding_busy_slots_reuses_them_only_once_flushed(engine_id):
    # cpu_bytes_to_use holds 4 chunks: one being written, one pinned by a load, two
    # readable when the cache is reset.
    spec, manager = manager_for(engine_id, cpu_bytes_to_use=4 * 4096)
    writing, pinned, idle = keys("w", 1), keys("p", 1), keys("i", 2)
    busy_slots = set(manager.prepare_store(writing, REQ).store_spec.chunk_ids)
    busy_slots |= set(store(manager, pinned).store_spec.chunk_ids)
    manager.prepare_load(pinned, REQ)
    store(manager, idle)
    manager.reset_cache(hold_busy_slots=True)
    assert all(manager.lookup(k, REQ) is LookupResult.MISS for k in writing + pinned + idle)
    fresh = keys("fresh", 4)
    out = manager.prepare_store(fresh[:2], REQ)
    assert out is not None and busy_slots.isdisjoint(out.store_spec.chunk_ids)
    # Only the two idle slots were free: the busy ones stay out until the flush.
    assert manager.prepare_store(fresh[2:], REQ) is None
    manager.on_reset_flushed()
    out = manager.prepare_store(fresh[2:], REQ)
    assert out is not None and set(out.store_spec.chunk_ids) == busy_slots
    spec.shutdown()


def test_a_plain_reset_frees_every_slot_at_once(engine_id):
    spec, manager = manager_for(engine_id, cpu_bytes_to_use=2 * 4096)
    manager.prepare_store(keys("w", 2), REQ)
    manager.reset_cache()
    assert manager.prepare_store(keys("fresh", 2), REQ) is not None
    spec.shutdown()
