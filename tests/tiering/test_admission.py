"""Load or recompute, and how long a request waits: promotions that would lose to
recomputing are misses, and a request's pending chunks become misses at its deadline."""

from __future__ import annotations

import anyio
import pytest
from helpers import keys, scripted
from scripted_tier import ScriptedTier
from tiering_helpers import HIT, MISS, PENDING, evict_all, fill, opened, resolve

from kvtier import ReqContext
from kvtier.metrics import Names
from kvtier.tiering.promotions import EXPLORE_SHARE, STALE_AFTER_S, PromotionCosts

pytestmark = pytest.mark.anyio


def skipped(manager) -> float:
    label = manager.diagnostics.tier_labels[0]
    return manager.diagnostics.tier_stats()[label]["skipped_slower_than_recompute"]


async def stored_in_tier_only(manager, count: int, prefix: str):
    """``count`` chunks stored, cascaded, then pushed out of the primary tier."""
    ks = keys(prefix, count)
    fill(manager, ks)
    await manager.drain()
    await evict_all(manager, manager.host.num_chunks)
    assert all(manager.primary.slot_of(key) is None for key in ks)
    return ks


async def step_while_pending(manager, key, req, limit_s: float = 10) -> None:
    """Look ``key`` up for ``req`` as a synchronous scheduler does, step by step, until
    the answer is no longer pending (failing after ``limit_s``)."""
    with anyio.fail_after(limit_s):
        while manager.lookup(key, req) is PENDING:
            manager.on_schedule_end()
            await anyio.sleep(0.02)


async def test_a_tier_slower_than_recomputing_answers_misses_once_measured(engine_id):
    # 0.2 s per one-chunk job against 0.01 s to recompute a chunk: loading loses.
    tier = scripted("slow", instant=True, load_delay_s=0.2)
    async with opened(engine_id, [tier], chunks=8, recompute_s_per_chunk=0.01) as manager:
        first, second = await stored_in_tier_only(manager, 2, "slow")
        # Nothing measured yet: the first hit is promoted, and its job measures the tier.
        assert manager.lookup(first, ReqContext("a")) is PENDING
        manager.on_schedule_end()
        await manager.drain()
        jobs = len(ScriptedTier.instances["slow"].load_jobs)
        assert jobs == 1
        assert manager.lookup(second, ReqContext("b")) is MISS
        assert len(ScriptedTier.instances["slow"].load_jobs) == jobs  # no job started
        assert skipped(manager) == 1
        assert manager.primary.slot_of(second) is None  # no slot was taken for it


async def test_a_tier_faster_than_recomputing_is_still_used(engine_id):
    tier = scripted("fast", instant=True)
    async with opened(engine_id, [tier], chunks=8, recompute_s_per_chunk=1.0) as manager:
        first, second = await stored_in_tier_only(manager, 2, "fast")
        assert await resolve(manager, first, ReqContext("a")) is HIT
        assert await resolve(manager, second, ReqContext("b")) is HIT
        assert skipped(manager) == 0


async def test_a_request_is_weighed_against_the_chunks_served_before_it_only(engine_id):
    tier = scripted("turns", instant=True, load_delay_s=0.2)
    async with opened(engine_id, [tier], chunks=8) as manager:
        measured, a1, b1, b2, b3, a2, c1 = await stored_in_tier_only(manager, 7, "turns")
        assert await resolve(manager, measured, ReqContext("m")) is HIT  # ~0.2 s a chunk
        manager.host.set_recompute_cost(1.0)
        assert manager.lookup(a1, ReqContext("a")) is PENDING  # request a's turn first
        for key in (b1, b2, b3):
            assert manager.lookup(key, ReqContext("b")) is PENDING
        manager.host.set_recompute_cost(0.35)
        # a's second chunk comes after a's first only, not after b's three: 2 x 0.2 s
        # against 2 x 0.35 s. A new request would queue after all four, and loses.
        assert manager.lookup(a2, ReqContext("a")) is PENDING
        assert manager.lookup(c1, ReqContext("c")) is MISS
        assert skipped(manager) == 1


async def test_the_recompute_cost_can_be_given_later_and_is_checked(engine_id):
    tier = scripted("later", instant=True, load_delay_s=0.2)
    async with opened(engine_id, [tier], chunks=8) as manager:
        first, second = await stored_in_tier_only(manager, 2, "later")
        assert await resolve(manager, first, ReqContext("a")) is HIT
        assert manager.lookup(second, ReqContext("b")) is PENDING  # no cost given: promote
        manager.host.expire_pending(ReqContext("b"))
        with pytest.raises(ValueError, match="seconds_per_chunk must be > 0"):
            manager.host.set_recompute_cost(0)
        manager.host.set_recompute_cost(0.01)
        assert manager.lookup(second, ReqContext("c")) in (MISS, PENDING)


async def test_pending_chunks_become_misses_at_the_request_deadline(engine_id):
    tier = scripted("held", instant=True)
    async with opened(engine_id, [tier], chunks=8, max_pending_s=0.2) as manager:
        [key] = await stored_in_tier_only(manager, 1, "held")
        ScriptedTier.instances["held"].gate.clear()  # the promotion cannot finish
        req = ReqContext("waiting")
        assert manager.lookup(key, req) is PENDING
        manager.on_schedule_end()
        # A synchronous scheduler looks its waiting requests up every step.
        await step_while_pending(manager, key, req)
        assert manager.lookup(key, req) is MISS  # the deadline passed
        # Another request still waits for the same promotion.
        assert manager.lookup(key, ReqContext("other")) is PENDING
        ScriptedTier.instances["held"].gate.set()
        await manager.drain()
        # The chunk landed, and is not kept for the request that gave up on it.
        assert manager.lookup(key, ReqContext("other")) is HIT
        assert manager.primary.num_busy == 0


async def test_a_request_that_gives_up_frees_its_queued_promotions(engine_id):
    tier = scripted("queued", instant=True)
    async with opened(engine_id, [tier], chunks=8) as manager:
        ks = await stored_in_tier_only(manager, 3, "queued")
        req = ReqContext("impatient")
        assert [manager.lookup(key, req) for key in ks] == [PENDING] * 3
        assert all(manager.primary.slot_of(key) is not None for key in ks)  # slots taken
        free = manager.primary.num_free
        manager.host.expire_pending(req)
        assert manager.primary.num_free == free + 3
        assert all(manager.lookup(key, req) is MISS for key in ks)
        assert not ScriptedTier.instances["queued"].load_jobs
        manager.on_request_finished(req)
        assert manager.lookup(ks[0], ReqContext("fresh")) is PENDING


async def test_a_tier_not_measured_yet_costs_a_request_a_tenth_of_its_recompute(engine_id):
    # Recomputing a chunk takes 5 s; the tier, never measured, has become a link whose
    # promotion does not end while the request waits (held by its gate).
    tier = scripted("probe", instant=True)
    async with opened(engine_id, [tier], chunks=8, recompute_s_per_chunk=5.0) as manager:
        *ks, spare = await stored_in_tier_only(manager, 3, "probe")
        probe = ScriptedTier.instances["probe"]
        probe.gate.clear()
        try:
            req = ReqContext("first")
            assert [manager.lookup(key, req) for key in ks] == [PENDING, PENDING]
            manager.on_schedule_end()
            # Two chunks, a tenth of 5 s each: the request's pending chunks are misses
            # after 1 s, not after the 10 s recomputing them takes.
            allowed = manager.host.pending_remaining_s(req)
            assert allowed is not None and allowed <= 2 * EXPLORE_SHARE * 5.0
            await step_while_pending(manager, ks[0], req, limit_s=8)
            assert manager.lookup(ks[1], req) is MISS
            assert manager.host.pending_remaining_s(req) == 0
            assert probe.load_jobs  # the probe goes on, and will measure the tier
            # A request that finds the chunk still on its way gets the same share.
            later = ReqContext("later")
            assert manager.lookup(ks[0], later) is PENDING
            allowed = manager.host.pending_remaining_s(later)
            assert allowed is not None and allowed <= EXPLORE_SHARE * 5.0
            await step_while_pending(manager, ks[0], later, limit_s=8)
            # Until the probe ends, its job holds the slots it fills (being written).
            assert all(manager.primary.ref_count(key) == -1 for key in ks)
        finally:
            probe.gate.set()
        await manager.drain()
        # It ended: the chunks are readable, held for neither request that gave up,
        # and the tier is measured.
        assert all(manager.primary.ref_count(key) == 0 for key in ks)
        assert manager.primary.num_busy == 0
        # A promotion from it now may cost a request the whole recompute, not a tenth.
        measured = ReqContext("measured")
        assert manager.lookup(spare, measured) is PENDING
        allowed = manager.host.pending_remaining_s(measured)
        assert allowed is not None and allowed > EXPLORE_SHARE * 5.0


async def test_a_tier_measured_fast_enough_is_waited_for_past_the_probe_share(engine_id):
    # Loading a chunk takes 1 s, recomputing it 5 s: the tier wins, but by less than
    # the tenth of a recompute a probe may cost. The first request gives up on it; its
    # job measures the tier, and the next request waits the 1 s and gets the chunk.
    tier = scripted("winner", instant=True, load_delay_s=1.0)
    async with opened(engine_id, [tier], chunks=8, recompute_s_per_chunk=5.0) as manager:
        first, second = await stored_in_tier_only(manager, 2, "winner")
        probe = ReqContext("probe")
        assert manager.lookup(first, probe) is PENDING
        manager.on_schedule_end()
        await step_while_pending(manager, first, probe)
        assert manager.lookup(first, probe) is MISS  # gave up after ~0.5 s
        await manager.drain()
        assert manager.host.pending_remaining_s(ReqContext("next")) is None
        assert await resolve(manager, second, ReqContext("next")) is HIT
        assert skipped(manager) == 0


def test_the_wait_a_promotion_allows_follows_the_tiers_measure():
    costs = PromotionCosts(1)
    assert costs.wait_allowance(0) is None  # no recompute cost: no bound
    costs.recompute_s_per_chunk = 2.0
    assert costs.wait_allowance(0) == pytest.approx(EXPLORE_SHARE * 2.0)
    costs.job_done(0, seconds=0.5, chunks=1)
    assert costs.wait_allowance(0) == pytest.approx(2.0)


def test_the_skip_counter_is_a_tiering_metric():
    from kvtier.metrics import tiering_metric_definitions

    assert Names.SKIPPED_SLOWER_THAN_RECOMPUTE in tiering_metric_definitions()


def test_a_tier_judged_too_slow_is_measured_again_once_its_measure_is_stale():
    now = [0.0]
    costs = PromotionCosts(1, recompute_s_per_chunk=0.01, clock=lambda: now[0])
    assert not costs.weighs(0)  # nothing measured: promote, and measure
    costs.job_done(0, seconds=1.0, chunks=1)
    assert costs.weighs(0) and costs.loses(0, ahead=0, own=0)
    now[0] += STALE_AFTER_S / 2
    assert costs.loses(0, ahead=0, own=0)  # still fresh: no promotion goes
    now[0] += STALE_AFTER_S
    # Nothing measured it since: its next hit is promoted, so a recovered link shows.
    assert not costs.weighs(0)
    costs.job_done(0, seconds=0.001, chunks=1)
    assert costs.weighs(0) and not costs.loses(0, ahead=0, own=0)
