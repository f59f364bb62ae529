"""Measured samples the manager keeps: the bounded reservoir, and promotion job times."""

from __future__ import annotations

import pytest
from helpers import keys, scripted, tiering_config
from scripted_tier import ScriptedTier

from kvtier import LookupResult, OffloadingSpecFactory, ReqContext
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
