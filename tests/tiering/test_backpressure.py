"""Back-pressure: the detector on a test clock, and its effect through the manager."""

from __future__ import annotations

import pytest
from helpers import keys, scripted, tiering_config
from scripted_tier import ScriptedTier

from kvtier import OffloadingSpecFactory, ReqContext
from kvtier.metrics import Names
from kvtier.tiering.backpressure import Backpressure, BackpressureSettings
from kvtier.tiering.loop import HostLoop

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def detector(**settings):
    clock = Clock()
    return Backpressure(BackpressureSettings(**settings), clock), clock


def slow(bp, count=1, seconds_per_mib=0.05):
    for _ in range(count):
        bp.record(seconds_per_mib, MIB)


def test_no_judgement_during_warmup():
    bp, _ = detector(warmup=3)
    slow(bp, 2)
    assert not bp.pressured
    slow(bp, 1)
    assert bp.pressured


def test_hysteresis_between_high_and_low_marks():
    bp, _ = detector(warmup=0, high_water=0.01, low_water=0.002, cooldown_s=0.0, alpha=1.0)
    bp.record(0.02, MIB)
    assert bp.pressured
    bp.record(0.005, MIB)  # between the marks: stays pressured
    assert bp.pressured
    bp.record(0.001, MIB)
    assert not bp.pressured


def test_pressure_clears_only_after_the_cooldown():
    bp, clock = detector(warmup=0, high_water=0.01, low_water=0.002, cooldown_s=1.0, alpha=1.0)
    bp.record(0.02, MIB)
    bp.record(0.001, MIB)
    assert bp.pressured
    clock.now += 1.5
    bp.record(0.001, MIB)
    assert not bp.pressured


def test_idle_decay_lets_a_fully_dropped_tier_recover():
    bp, clock = detector(policy="drop", warmup=0, decay_half_life_s=2.0, cooldown_s=0.0)
    slow(bp, 3, 0.05)
    assert not bp.admit(1)
    clock.now += 30  # no cascade reached the tier: the average decays
    assert bp.admit(1)


def test_drop_policy_drops_every_cascade_and_counts_chunks():
    bp, _ = detector(policy="drop", warmup=0)
    slow(bp, 3)
    assert [bp.admit(4) for _ in range(3)] == [False] * 3
    assert bp.take_dropped() == (3, 12)
    assert bp.take_dropped() == (0, 0)


def test_throttled_policy_drops_a_share_growing_to_all_at_three_times_high():
    bp, _ = detector(warmup=0, high_water=0.01, alpha=1.0)
    bp.record(0.02, MIB)  # halfway from the high mark to three times it
    admitted = sum(bp.admit(1) for _ in range(100))
    assert admitted == 50
    bp.record(0.03, MIB)
    assert sum(bp.admit(1) for _ in range(10)) == 0


def test_a_failure_counts_as_pressure():
    bp, _ = detector(warmup=0, alpha=1.0)
    bp.record(0.0, MIB, failed=True)
    assert bp.pressured


def test_failures_in_a_row_reach_the_failure_threshold_even_while_warming_up():
    bp, _ = detector(warmup=10, failure_threshold=3, policy="drop")
    bp.record(0.0, MIB, failed=True)
    bp.record(0.0, MIB, failed=True)
    assert not bp.pressured  # two failures are not yet a failing tier
    bp.record(0.0, MIB, failed=True)
    assert bp.pressured and not bp.admit(1)


def test_a_store_that_succeeds_starts_the_failure_count_again():
    bp, _ = detector(warmup=0, failure_threshold=2)
    bp.record(0.0, MIB, failed=True)
    bp.record(0.0001, MIB)
    bp.record(0.0, MIB, failed=True)
    assert not bp.pressured and bp.failures_in_a_row == 1


def test_a_tier_under_pressure_for_its_failures_recovers_by_idle_decay():
    bp, clock = detector(warmup=10, failure_threshold=1, policy="drop", cooldown_s=0.0)
    bp.record(0.0, MIB, failed=True)
    assert not bp.admit(1)
    clock.now += 30  # nothing reached the tier: the average decays below the low mark
    assert bp.admit(1) and not bp.pressured


def test_small_stores_are_not_inflated_per_mib():
    bp, _ = detector(warmup=0, alpha=1.0, high_water=0.005)
    bp.record(0.0005, 4096)  # 0.5 ms for 4 KiB is no sign of pressure
    assert not bp.pressured


@pytest.mark.anyio
async def test_a_slow_tier_gets_its_cascades_dropped_and_counted_while_loads_still_run(engine_id):
    tiers = [
        scripted(
            "pressure",
            instant=True,
            backpressure={"policy": "drop", "warmup": 1, "high_water": 1e-6, "low_water": 1e-7},
        )
    ]
    spec = OffloadingSpecFactory.create_spec(tiering_config(engine_id, tiers, chunks=16))
    manager = spec.get_manager(loop=HostLoop())
    await manager.start()
    tier = ScriptedTier.instances["pressure"]
    try:
        writer = ReqContext("w")
        for i in range(6):
            ks = keys(f"bp{i}", 1)
            out = manager.prepare_store(ks, writer)
            assert out is not None
            manager.complete_store(ks, writer)
            await manager.drain()
        manager.on_schedule_end()
        label = {"tier": "1:ScriptedTier"}
        dropped = manager.metrics.sample(f"{Names.BACKPRESSURE_STORES_DROPPED}_total", label)
        assert dropped == 5  # the first cascade set the average; every later one dropped
        assert len(tier.store_jobs) == 1
        assert manager.metrics.sample(f"{Names.BACKPRESSURE_STORE_LATENCY_EMA}", label) > 1e-6
        # Promotions are never dropped.
        [stored] = tier.store_jobs[0].keys
        manager.primary.reset()
        reader = ReqContext("r")
        manager.lookup(stored, reader)
        manager.on_schedule_end()
        await manager.drain()
        assert len(tier.load_jobs) == 1
    finally:
        await manager.aclose()
        await spec.aclose()


def test_a_reset_detector_judges_afresh():
    bp, _ = detector(policy="drop", warmup=2, alpha=1.0)
    slow(bp, 3)
    assert not bp.admit(1)
    bp.reset()
    assert (bp.ema, bp.completions, bp.pressured) == (0.0, 0, False)
    assert bp.admit(1)
    slow(bp, 1)  # the warm-up counts from the reset again
    assert bp.admit(1)
    slow(bp, 1)
    assert not bp.admit(1)
    # Drops counted before and after the reset are all reported.
    assert bp.take_dropped() == (2, 2)


def test_a_reset_forgets_failures_in_a_row():
    bp, _ = detector(warmup=10, failure_threshold=2, policy="drop")
    bp.record(0.0, MIB, failed=True)
    bp.record(0.0, MIB, failed=True)
    assert not bp.admit(1)
    bp.reset()
    assert bp.admit(1)
    bp.record(0.0, MIB, failed=True)  # one failure after the reset: not yet a failing tier
    assert bp.admit(1) and bp.failures_in_a_row == 1


# A store takes far longer than a microsecond per MiB: one cascade pressures the tier.
_PRESSURED = {"policy": "drop", "warmup": 1, "high_water": 1e-6, "low_water": 1e-7}


def _cascades_reaching(tier: ScriptedTier) -> int:
    return len(tier.store_jobs)


@pytest.mark.anyio
async def test_reset_cache_lets_a_pressured_tiers_next_cascade_through(engine_id):
    spec = OffloadingSpecFactory.create_spec(
        tiering_config(engine_id, [scripted("reset-bp", backpressure=_PRESSURED)], chunks=16)
    )
    manager = spec.get_manager(loop=HostLoop())
    await manager.start()
    tier = ScriptedTier.instances["reset-bp"]
    writer = ReqContext("w")

    async def store(name: str) -> None:
        ks = keys(name, 1)
        assert manager.prepare_store(ks, writer) is not None
        manager.complete_store(ks, writer)
        await manager.drain()

    try:
        await store("before-1")  # sets the average far above the high mark
        await store("before-2")
        assert _cascades_reaching(tier) == 1  # the second was dropped
        await manager.areset_cache()
        # The average decays over seconds, not here: only the reset lets this through.
        await store("after")
        assert _cascades_reaching(tier) == 2
        await store("after-2")  # judged afresh: pressured again by the one it measured
        assert _cascades_reaching(tier) == 2
    finally:
        await manager.aclose()
        await spec.aclose()


def test_a_sync_hosts_reset_cache_resets_back_pressure_too(engine_id):
    spec = OffloadingSpecFactory.create_spec(
        tiering_config(engine_id, [scripted("reset-bp-sync", backpressure=_PRESSURED)], chunks=16)
    )
    manager = spec.get_manager()
    tier = ScriptedTier.instances["reset-bp-sync"]
    writer = ReqContext("w")

    def store(name: str) -> None:
        ks = keys(name, 1)
        assert manager.prepare_store(ks, writer) is not None
        manager.complete_store(ks, writer)
        while manager.has_pending_work():
            manager.on_schedule_end()
            manager.host.wait_for_completions_blocking(0.1)

    try:
        store("before-1")
        store("before-2")
        assert _cascades_reaching(tier) == 1
        manager.reset_cache()
        store("after")
        assert _cascades_reaching(tier) == 2
    finally:
        spec.shutdown()
