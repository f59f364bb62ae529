"""What the manager counts and keeps: chunk queries and hits with vLLM's meaning, the
bounded reservoir, and promotion job times."""

from __future__ import annotations

import pytest
import torch
from helpers import keys, scripted, tiering_config
from scripted_tier import ScriptedTier
from tiering_helpers import HIT, MISS, WRITER, fill, opened

from kvtier import KVTier, LookupResult, OffloadingSpecFactory, ReqContext, ScheduleEndContext
from kvtier.metrics import Names
from kvtier.tiering.loop import HostLoop
from kvtier.tiering.reporting import Counts, Reservoir


def test_a_reservoir_below_its_capacity_holds_every_value_in_order():
    reservoir = Reservoir(capacity=10)
    reservoir.extend([3.0, 1.0, 2.0])
    assert reservoir.values == [3.0, 1.0, 2.0]
    assert reservoir.seen == 3


def test_a_full_reservoir_stays_bounded_and_samples_the_whole_stream():
    reservoir = Reservoir(capacity=100)
    reservoir.extend(float(i) for i in range(10_000))
    assert len(reservoir.values) == 100
    assert reservoir.seen == 10_000
    assert len(set(reservoir.values)) == 100
    assert all(0 <= value < 10_000 for value in reservoir.values)
    # Not just the first hundred: later values replaced earlier ones.
    assert max(reservoir.values) >= 100


def test_a_reservoir_needs_room_for_one_value():
    with pytest.raises(ValueError, match="capacity of at least 1"):
        Reservoir(capacity=0)


def test_only_measured_names_keep_their_samples():
    counts = Counts("1:fs")
    with pytest.raises(ValueError, match=Names.LOOKUP_SYNC_DELAY):
        counts.measured(Names.LOOKUP_SYNC_DELAY)


@pytest.mark.anyio
async def test_promotion_latencies_are_one_measured_time_per_job(engine_id):
    delay = 0.02
    spec = OffloadingSpecFactory.create_spec(
        tiering_config(engine_id, [scripted("timed", instant=True, load_delay_s=delay)])
    )
    manager = spec.get_manager(loop=HostLoop())
    try:
        await manager.start()
        stored = keys("timed", 4)
        writer = ReqContext("writer")
        out = manager.prepare_store(stored, writer)
        assert out is not None
        manager.complete_store(stored, writer)
        await manager.drain()
        await manager.areset_cache()
        requests = [(ReqContext("a"), stored[:2]), (ReqContext("b"), stored[2:])]
        for _ in range(50):
            results = [manager.lookup(key, req) for req, ks in requests for key in ks]
            if all(result is LookupResult.HIT for result in results):
                break
            manager.on_schedule_end()
            await manager.wait_for_completions()
        else:
            raise AssertionError("the promotions never finished")
        label = manager.diagnostics.tier_labels[0]
        before_flush = manager.diagnostics.promotion_latencies()[label]
        manager.on_schedule_end()
        latencies = manager.diagnostics.promotion_latencies()[label]
        jobs = ScriptedTier.instances["timed"].load_jobs
        assert len(jobs) == 2
        assert len(latencies) == len(before_flush) == 2  # flushed or not, counted once
        assert sorted(latencies) == sorted(before_flush)
        assert all(latency >= delay for latency in latencies)
        # A job's own time starts when it went to the tier: within its latency.
        job_times = manager.diagnostics.promotion_job_times()[label]
        assert len(job_times) == 2
        assert all(delay <= job_time for job_time in job_times)
        assert sum(job_times) <= sum(latencies)
        count = manager.metrics.sample(f"{Names.PROMOTION_LATENCY}_count", {"tier": label})
        assert count == 2
    finally:
        await manager.aclose()
        await spec.aclose()


async def look(manager, req, ks) -> list[LookupResult]:
    """Look ``ks`` up for ``req`` every step, as a scheduler does while the request
    waits, until every answer is HIT or MISS; then twice more."""
    settled = 0
    for _ in range(50):
        mark = manager.host.completion_mark
        results = [manager.lookup(key, req) for key in ks]
        if all(result in (HIT, MISS) for result in results):
            settled += 1
            if settled == 3:
                return results
            continue
        manager.on_schedule_end()
        await manager.wait_for_completions(since=mark)
    raise AssertionError("the lookups never settled")


def counted(manager) -> dict[str, tuple[float, float]]:
    """(chunk_queries, chunk_hits) so far, by tier label."""
    stats = manager.diagnostics.tier_stats()
    return {label: (tier["queries"], tier["hits"]) for label, tier in stats.items()}


@pytest.mark.anyio
async def test_a_request_counts_each_key_once_per_tier_until_it_is_scheduled(engine_id):
    # The tier answers through its async lookup only: a request waits a few steps for
    # it, then for the promotion, looking its keys up again each step.
    async with opened(engine_id, [scripted("counted")], chunks=8) as manager:
        stored, absent = keys("counted", 2), keys("absent", 2)
        fill(manager, stored)
        await manager.drain()
        await manager.areset_cache()  # the stored keys are in the tier alone now
        first = ReqContext("first")
        assert await look(manager, first, [*stored, absent[0]]) == [HIT, HIT, MISS]
        # Each key once: the primary tier missed all three, the tier held two.
        assert counted(manager) == {"0:primary": (3, 0), "1:ScriptedTier": (3, 2)}
        # A new request counts again: two primary hits, and the tier asked the absent
        # key for it.
        second = ReqContext("second")
        assert await look(manager, second, [*stored, absent[0]]) == [HIT, HIT, MISS]
        assert counted(manager) == {"0:primary": (6, 2), "1:ScriptedTier": (4, 2)}
        # Scheduled: its lookups (a preempted request's, say) count no more.
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=["second"]))
        assert await look(manager, second, [*stored, *absent]) == [HIT, HIT, MISS, MISS]
        assert counted(manager) == {"0:primary": (6, 2), "1:ScriptedTier": (4, 2)}
        # What was counted for each request goes with it.
        for req in (first, second, WRITER):
            manager.on_request_finished(req)
        await manager.drain()
        assert manager.diagnostics.tracked_requests == 0


@pytest.mark.anyio
async def test_requests_waiting_for_one_answer_count_what_each_saw(engine_id):
    async with opened(engine_id, [scripted("shared")], chunks=8) as manager:
        [key] = keys("shared", 1)
        fill(manager, [key])
        await manager.drain()
        await manager.areset_cache()
        tier = ScriptedTier.instances["shared"]
        tier.gate.clear()  # both ask before the tier answers: one lookup for both
        a, b = ReqContext("a"), ReqContext("b")
        manager.lookup(key, a)
        manager.lookup(key, b)
        manager.on_schedule_end()
        tier.gate.set()
        assert await look(manager, a, [key]) == [HIT]
        assert await look(manager, b, [key]) == [HIT]
        assert len(tier.lookup_calls) == 1
        # Both missed in the primary tier. a saw the tier's hit, which promoted the key;
        # b found the key on its way into the primary tier before it looked at the
        # tier's answer, and a key on its way is no answer: the tier's hit is a's alone.
        assert counted(manager) == {"0:primary": (2, 0), "1:ScriptedTier": (1, 1)}


@pytest.mark.anyio
async def test_a_request_that_stores_was_scheduled_and_counts_no_more(engine_id):
    async with opened(engine_id, [{"type": "example"}], chunks=8) as manager:
        req = ReqContext("computes")
        absent = keys("absent", 2)
        manager.lookup(absent[0], req)
        fill(manager, keys("computed", 1), req)
        manager.lookup(absent[1], req)
        assert counted(manager) == {"0:primary": (1, 0), "1:example": (1, 0)}


@pytest.mark.anyio
async def test_a_waiting_request_counts_its_keys_once_across_a_cache_reset(engine_id):
    async with opened(engine_id, [{"type": "example"}], chunks=8) as manager:
        [key] = keys("reset", 1)
        req = ReqContext("waits")
        assert await look(manager, req, [key]) == [MISS]
        await manager.areset_cache()
        assert await look(manager, req, [key]) == [MISS]
        assert counted(manager) == {"0:primary": (1, 0), "1:example": (1, 0)}
        manager.on_request_finished(req)
        assert manager.diagnostics.tracked_requests == 0


@pytest.mark.anyio
async def test_the_facade_counts_a_requests_chunks_once_however_long_it_waits(engine_id):
    # The facade steps the manager itself while a lookup waits for the tier's answers
    # and the promotions; a host request counts as a scheduler's does.
    kv_cache = torch.zeros((16, 4096), dtype=torch.uint8)
    config = tiering_config(engine_id, [scripted("facade-counts")], chunks=8)
    async with KVTier(config, [kv_cache]) as kv:
        ks = keys("facade-counts", 4)
        assert await kv.store(ks, [0, 1, 2, 3], "writer") == 4
        await kv.drain()
        await kv.reset()  # the chunks are in the tier alone now
        assert await kv.lookup(ks, "reader", timeout=30) == 4
        assert await kv.load(ks, [4, 5, 6, 7], "reader") == 4
        assert await kv.lookup(ks, "reader") == 4  # asked again: counted once
        assert counted(kv.manager) == {"0:primary": (4, 0), "1:ScriptedTier": (4, 4)}
        kv.finish("reader")
        assert await kv.lookup(ks, "another") == 4
        assert counted(kv.manager) == {"0:primary": (8, 4), "1:ScriptedTier": (4, 4)}
        kv.finish("another")
        kv.finish("writer")
        await kv.drain()
        assert kv.manager.diagnostics.tracked_requests == 0
