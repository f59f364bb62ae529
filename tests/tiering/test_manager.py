"""The tiering manager's protocol, run against plug-in tiers on the host's event loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from helpers import keys, scripted
from scripted_tier import ScriptedTier
from tiering_helpers import (
    HIT,
    MISS,
    PENDING,
    RETRY,
    WRITER,
    evict_all,
    fill,
    opened,
    resolve,
    settle,
)

from kvtier import ReqContext
from kvtier.metrics import Names

pytestmark = pytest.mark.anyio


async def test_secondary_hit_is_promoted_and_served_with_the_stored_bytes(engine_id):
    async with opened(engine_id, [{"type": "example"}], chunks=4) as manager:
        [key] = keys("promote", 1)
        fill(manager, [key])
        await settle(manager)
        original = bytes(manager.region.primary_view[manager.primary.slot_of(key)])
        await evict_all(manager, 4)
        req = ReqContext("reader")
        assert manager.lookup(key, req) is PENDING  # example tier answers from memory
        assert await resolve(manager, key, req) is HIT
        spec_load = manager.prepare_load([key], req)
        assert bytes(manager.region.primary_view[spec_load.chunk_ids[0]]) == original
        manager.complete_load([key], req)


async def test_unknown_keys_answer_retry_then_are_asked_in_one_batch_per_step(engine_id):
    async with opened(engine_id, [scripted("batch")], chunks=4) as manager:
        tier = ScriptedTier.instances["batch"]
        ks = keys("batch", 3)
        req = ReqContext("r")
        assert [manager.lookup(k, req) for k in ks] == [RETRY] * 3
        assert manager.has_pending_work()
        manager.on_schedule_end()
        await settle(manager)
        assert tier.lookup_calls == [tuple(ks)]
        assert [manager.lookup(k, req) for k in ks] == [MISS] * 3
        assert len(tier.lookup_calls) == 1  # answers are kept for the request


async def test_a_wait_from_a_mark_ends_for_a_completion_applied_before_it_began(engine_id):
    async with opened(engine_id, [scripted("marked")], chunks=4) as manager:
        [key] = keys("marked", 1)
        req = ReqContext("r")
        mark = manager.host.completion_mark
        assert manager.lookup(key, req) is RETRY
        manager.on_schedule_end()
        await settle(manager)  # the tier answered, and its answer is applied
        # A host that checked before the answer came and waits only now: from the
        # mark it read before checking, its wait ends at once, blocking or not.
        await asyncio.wait_for(manager.wait_for_completions(since=mark), 10)
        started = time.monotonic()
        manager.host.wait_for_completions_blocking(30, since=mark)
        assert time.monotonic() - started < 20
        # Without the mark the same wait sees nothing new and goes on waiting.
        waiter = asyncio.ensure_future(manager.wait_for_completions())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        waiter.cancel()
        manager.on_request_finished(req)


async def test_a_thread_asleep_in_a_blocking_wait_is_woken_by_a_store_completing(engine_id):
    async with opened(engine_id, [scripted("woken")], chunks=4) as manager:
        [key] = keys("woken", 1)
        req = ReqContext("r")
        assert manager.prepare_store([key], req) is not None
        woke = threading.Event()

        def wait() -> None:
            manager.host.wait_for_completions_blocking(30)
            woke.set()

        waiter = threading.Thread(target=wait)
        waiter.start()
        # The store completes only once the thread sleeps in the wait (the queue
        # counts its sleepers: a notify with none skips the condition's wake-up), so
        # only that wake-up can end the wait before its 30 s.
        queue = manager.host._completions

        def until_asleep() -> None:
            while not queue._sleepers and not woke.is_set():
                time.sleep(0.001)

        await asyncio.to_thread(until_asleep)
        manager.complete_store([key], req)
        assert await asyncio.to_thread(woke.wait, 20)
        waiter.join()
        manager.on_request_finished(req)


async def test_a_key_is_promoted_once_when_two_requests_ask_in_one_step(engine_id):
    async with opened(engine_id, [scripted("once", instant=True)], chunks=4) as manager:
        tier = ScriptedTier.instances["once"]
        [key] = keys("once", 1)
        fill(manager, [key])
        await settle(manager)
        await evict_all(manager, 4)
        first, second = ReqContext("a"), ReqContext("b")
        assert manager.lookup(key, first) is PENDING
        assert manager.lookup(key, second) is PENDING
        manager.on_schedule_end()
        await settle(manager)
        assert [job.keys for job in tier.load_jobs] == [(key,)]
        assert manager.lookup(key, second) is HIT


async def test_one_promotion_job_per_tier_and_request(engine_id):
    async with opened(engine_id, [scripted("perreq", instant=True)], chunks=8) as manager:
        tier = ScriptedTier.instances["perreq"]
        ks = keys("perreq", 4)
        fill(manager, ks)
        await settle(manager)
        await evict_all(manager, 8)
        for key in ks[:3]:
            manager.lookup(key, ReqContext("a"))
        manager.lookup(ks[3], ReqContext("b"))
        manager.on_schedule_end()
        await settle(manager)
        assert sorted((job.req_id, len(job.keys)) for job in tier.load_jobs) == [("a", 3), ("b", 1)]


async def test_partial_promotion_frees_the_failed_slots_and_forgets_the_hit(engine_id):
    async with opened(engine_id, [scripted("partial", instant=True)], chunks=4) as manager:
        tier = ScriptedTier.instances["partial"]
        good, bad = keys("partial", 2)
        fill(manager, [good, bad])
        await settle(manager)
        await evict_all(manager, 4)
        manager.primary.reset()  # an empty primary: every slot free
        tier.lose_on_load.add(bad)
        req = ReqContext("r")
        assert manager.lookup(good, req) is PENDING
        assert manager.lookup(bad, req) is PENDING
        manager.on_schedule_end()
        await settle(manager)
        assert manager.lookup(good, req) is HIT
        assert manager.primary.num_free == 3
        del tier.chunks[bad]
        assert manager.lookup(bad, req) is MISS  # asked again instead of trusting the old hit


async def test_no_free_primary_slot_makes_a_secondary_hit_a_counted_miss(engine_id):
    async with opened(engine_id, [scripted("full", instant=True)], chunks=2) as manager:
        [key] = keys("full", 1)
        fill(manager, [key])
        await settle(manager)
        pinned = keys("pinned", 2)
        fill(manager, pinned)
        await settle(manager)
        manager.prepare_load(pinned, ReqContext("reader"))
        assert manager.lookup(key, ReqContext("r")) is MISS
        manager.on_schedule_end()
        assert manager.metrics.sample(f"{Names.PROMOTION_ALLOCATION_FAILURES}_total") == 1
        manager.complete_load(pinned, ReqContext("reader"))


async def test_cascades_go_to_every_tier_and_pin_until_each_is_done(engine_id):
    async with opened(engine_id, [scripted("c1"), scripted("c2")], chunks=4) as manager:
        slow = ScriptedTier.instances["c2"]
        slow.gate.clear()
        [key] = keys("cascade", 1)
        fill(manager, [key])
        for _ in range(5):
            await asyncio.sleep(0)
        manager.on_schedule_end()  # a poll point: the fast tier's outcome is taken in
        assert key in ScriptedTier.instances["c1"].chunks
        assert manager.primary.ref_count(key) == 1  # still pinned by the slow tier
        assert manager.prepare_store(keys("other", 4), ReqContext("o")) is None
        assert manager.lookup(key, ReqContext("r")) is HIT
        slow.gate.set()
        await settle(manager)
        assert manager.primary.ref_count(key) == 0
        assert key in slow.chunks


async def test_tiers_hear_a_request_finished_only_after_its_stores_completed(engine_id):
    async with opened(engine_id, [scripted("fin")], chunks=4) as manager:
        tier = ScriptedTier.instances["fin"]
        req = ReqContext("req")
        ks = keys("fin", 2)
        assert manager.prepare_store(ks, req) is not None
        manager.on_request_finished(req)
        assert tier.finished_requests == []
        manager.complete_store(ks, req)
        assert tier.finished_requests == ["req"]


async def test_a_failing_tier_is_a_counted_miss_not_an_error(engine_id, caplog):
    async with opened(engine_id, [scripted("broken", instant=True)], chunks=4) as manager:
        tier = ScriptedTier.instances["broken"]
        tier.fail_stores = True
        [key] = keys("broken", 1)
        fill(manager, [key])
        await settle(manager)
        manager.on_schedule_end()
        label = {"tier": "1:ScriptedTier"}
        assert manager.metrics.sample(f"{Names.CASCADE_JOB_FAILURES}_total", label) == 1
        assert "cascade job" in caplog.text and "scripted store failure" in caplog.text
        tier.chunks[key] = b"\0" * manager.host.num_chunks
        tier.fail_loads = True
        await evict_all(manager, 4)
        req = ReqContext("r")
        assert await resolve(manager, key, req) is MISS
        manager.on_schedule_end()
        assert manager.metrics.sample(f"{Names.PROMOTION_JOB_FAILURES}_total", label) == 1


async def test_a_stuck_promotion_times_out_as_a_miss_and_keeps_its_slot_until_released(engine_id):
    tier_config = scripted("stuck", instant=True, job_timeout_s=0.05)
    async with opened(engine_id, [tier_config], chunks=2) as manager:
        tier = ScriptedTier.instances["stuck"]
        [key] = keys("stuck", 1)
        fill(manager, [key])
        await settle(manager)
        await evict_all(manager, 2)
        manager.primary.reset()
        tier.gate.clear()
        tier.ignore_cancel = True
        req = ReqContext("r")
        assert manager.lookup(key, req) is PENDING
        manager.on_schedule_end()
        while manager.lookup(key, req) is PENDING:
            await manager.wait_for_completions()
        assert manager.lookup(key, req) is MISS
        assert manager.primary.num_free == 1  # the slot stays out until the I/O stops
        tier.gate.set()
        await settle(manager)
        assert manager.primary.num_free == 2


async def test_the_first_hit_in_tier_order_wins_and_unresolved_tiers_do_not_block_it(engine_id):
    async with opened(
        engine_id, [scripted("slowlookup"), scripted("fast", instant=True)], chunks=4
    ) as manager:
        first, second = ScriptedTier.instances["slowlookup"], ScriptedTier.instances["fast"]
        [key] = keys("order", 1)
        second.chunks[key] = b"x" * manager.region.chunk_bytes
        first.gate.clear()
        req = ReqContext("r")
        assert manager.lookup(key, req) is PENDING  # tier 1 unresolved, tier 2 hit
        manager.on_schedule_end()
        first.gate.set()
        await settle(manager)
        assert manager.lookup(key, req) is HIT
        assert [job.keys for job in second.load_jobs] == [(key,)]
        assert first.load_jobs == []


async def test_events_come_primary_first_then_each_tier(engine_id):
    async with opened(engine_id, [{"type": "example"}], chunks=4, enable_kv_events=True) as manager:
        [key] = keys("events", 1)
        fill(manager, [key])
        await settle(manager)
        events = manager.take_events()
        assert [(e.tier, e.removed, e.keys) for e in events] == [
            ("0:primary", False, (key,)),
            ("1:example", False, (key,)),
        ]


async def test_a_tier_with_enable_kv_events_false_reports_no_events(engine_id):
    tiers = [{"type": "example", "enable_kv_events": False}, {"type": "example"}]
    async with opened(engine_id, tiers, chunks=4, enable_kv_events=True) as manager:
        [key] = keys("quiet", 1)
        fill(manager, [key])
        await settle(manager)
        events = manager.take_events()
        assert [e.tier for e in events] == ["0:primary", "2:example"]


async def test_reset_cache_keeps_secondary_data(engine_id):
    async with opened(engine_id, [{"type": "example"}], chunks=4) as manager:
        [key] = keys("reset", 1)
        fill(manager, [key])
        await manager.areset_cache()
        req = ReqContext("r")
        assert manager.lookup(key, req) is PENDING
        assert await resolve(manager, key, req) is HIT


async def test_metrics_count_queries_hits_bytes_and_latency_per_tier(engine_id):
    async with opened(engine_id, [{"type": "example"}], chunks=4) as manager:
        ks = keys("metrics", 2)
        fill(manager, ks)
        await settle(manager)
        await evict_all(manager, 4)
        req = ReqContext("r")
        for key in ks:
            await resolve(manager, key, req)
        manager.on_schedule_end()
        sample = manager.metrics.sample
        tier = {"tier": "1:example"}
        assert sample(f"{Names.CHUNK_QUERIES}_total", tier) == 2
        assert sample(f"{Names.CHUNK_HITS}_total", tier) == 2
        assert (
            sample(f"{Names.WRITE_BYTES}_total", tier) == 6 * manager.region.chunk_bytes
        )  # + fillers
        assert sample(f"{Names.READ_BYTES}_total", tier) == 2 * manager.region.chunk_bytes
        assert sample(f"{Names.PROMOTION_LATENCY}_count", tier) >= 1
        # The primary tier answered the request once per key: a miss. The lookups that
        # found the promoted chunks readable are that key's again, not counted twice.
        primary = manager.diagnostics.tier_stats()["0:primary"]
        assert (primary["queries"], primary["hits"]) == (2, 0)


async def test_shutdown_drains_jobs_and_closes_tiers_once(engine_id):
    async with opened(engine_id, [scripted("drain")], chunks=4) as manager:
        tier = ScriptedTier.instances["drain"]
        tier.gate.clear()
        fill(manager, keys("drain", 2))
        closing = asyncio.ensure_future(manager.aclose())
        await asyncio.sleep(0.05)
        assert not closing.done()
        tier.gate.set()
        await closing
        assert tier.closed and len(tier.chunks) == 2
        assert manager.region.closed


async def test_a_tier_can_pin_and_read_this_node_s_primary_chunks(engine_id):
    async with opened(engine_id, [scripted("reader")], chunks=4) as manager:
        tier = ScriptedTier.instances["reader"]
        present, absent = keys("pin", 2)
        fill(manager, [present])
        await settle(manager)
        expected = bytes(manager.region.primary_view[manager.primary.slot_of(present)])
        async with tier.ctx.primary.pinned([present, absent]) as rows:
            assert list(rows) == [present]
            assert bytes(rows[present]) == expected
            assert manager.primary.ref_count(present) == 1
            # A pinned chunk survives pressure to evict it.
            assert manager.prepare_store(keys("push", 4), ReqContext("p")) is None
        await asyncio.sleep(0)
        manager.on_schedule_end()
        assert manager.primary.ref_count(present) == 0


async def test_tiers_hear_which_keys_left_the_primary_tier(engine_id):
    async with opened(engine_id, [scripted("removed")], chunks=2) as manager:
        tier = ScriptedTier.instances["removed"]
        first = keys("first", 2)
        fill(manager, first)
        await settle(manager)
        fill(manager, keys("second", 1))
        assert tier.removed_from_primary == first[1:]  # a prefix loses its tail first
        await settle(manager)
        await manager.areset_cache()
        assert set(tier.removed_from_primary) >= {first[0], *keys("second", 1)}


async def test_shutdown_grace_bounds_how_long_close_waits_for_a_stuck_tier(engine_id):
    stuck = scripted(
        "stuck", instant=True, job_timeout_s=0.05, lookup_timeout_s=0.05, shutdown_grace_s=0.1
    )
    async with opened(engine_id, [stuck], chunks=4) as manager:
        tier = ScriptedTier.instances["stuck"]
        tier.gate.clear()
        tier.ignore_cancel = True  # like a thread that cannot be interrupted
        fill(manager, keys("stuck", 1))
        manager.on_schedule_end()
        loop = asyncio.get_running_loop()
        started = loop.time()
        await manager.aclose()
        # Job timeout, then the grace twice (before and after cancelling): well under
        # the seconds the default grace of 5 s would take.
        assert loop.time() - started < 3
        assert tier.closed
        tier.gate.set()


async def test_concurrent_prompts_in_a_tight_primary_promote_nothing_twice(engine_id):
    # Four prompts of 4 chunks, a primary of 14: the last prompt finds room for two.
    async with opened(engine_id, [scripted("keep", instant=True)], chunks=14) as manager:
        tier = ScriptedTier.instances["keep"]
        prompts = [keys(f"prompt-{i}", 4) for i in range(4)]
        for prompt in prompts:
            fill(manager, prompt)
            await settle(manager)
        await manager.areset_cache()
        requests = [ReqContext(f"r{i}") for i in range(4)]
        first_pass = [
            [manager.lookup(k, req) for k in p] for p, req in zip(prompts, requests, strict=True)
        ]
        assert first_pass[3] == [PENDING, PENDING, MISS, MISS]
        manager.on_schedule_end()
        await settle(manager)  # all promoted; no request has loaded yet
        # The request that found no room asks again first: it may evict nothing kept for
        # the others, so it still misses, and they find all their chunks.
        assert [manager.lookup(k, requests[3]) for k in prompts[3]] == [HIT, HIT, MISS, MISS]
        for prompt, req in zip(prompts[:3], requests[:3], strict=True):
            assert [manager.lookup(k, req) for k in prompt] == [HIT] * 4
            manager.prepare_load(prompt, req)
            manager.complete_load(prompt, req)
            manager.on_request_finished(req)
        promoted = [key for job in tier.load_jobs for key in job.keys]
        assert len(promoted) == len(set(promoted)) == 14
        # Loaded chunks are evictable again; the last request's stay kept until it ends.
        assert manager.primary.num_busy == 2
        manager.on_request_finished(requests[3])
        assert manager.primary.num_busy == 0


async def test_a_prefix_lookup_never_evicts_the_prefix_it_resolves(engine_id):
    async with opened(engine_id, [scripted("prefix", instant=True)], chunks=10) as manager:
        tier = ScriptedTier.instances["prefix"]
        first, second = keys("head", 7), keys("later", 7)
        for prompt, writer in ((first, ReqContext("first")), (second, ReqContext("second"))):
            for batch in (prompt[:4], prompt[4:]):
                fill(manager, batch, writer)
                await settle(manager)
        resident = [key for key in first if manager.primary.slot_of(key) is not None]
        assert resident == first[:3]  # the older prefix lost its tail
        req = ReqContext("again")
        found = manager.host.lookup_prefix(first, req)
        assert found.pending and list(found.pinned) == first[:3]
        manager.on_schedule_end()
        await settle(manager)
        # The promotions took the later prefix's slots, never the pinned head's.
        found = manager.host.lookup_prefix(first, req)
        assert not found.pending and list(found.pinned) == first[3:]
        assert [key for job in tier.load_jobs for key in job.keys] == first[3:]
        manager.complete_load(first, req)


async def test_a_key_by_key_lookup_never_evicts_what_the_request_found_readable(engine_id):
    # vLLM and the page store look a prefix up one key at a time, then pin the hits:
    # the promotion a later key starts must not take the slot of a hit before it.
    async with opened(engine_id, [scripted("own", instant=True)], chunks=1) as manager:
        head, tail = keys("own", 2)
        for key in (tail, head):  # the tail reaches the tier; the head keeps the slot
            fill(manager, [key])
            await settle(manager)
        req = ReqContext("reader")
        assert manager.lookup(head, req) is HIT
        assert manager.lookup(tail, req) is MISS  # no slot but the head's: a counted miss
        assert manager.metrics.sample(f"{Names.PROMOTION_ALLOCATION_FAILURES}_total") == 1
        spec = manager.prepare_load([head], req)
        assert spec.chunk_ids == [manager.primary.slot_of(head)]
        manager.complete_load([head], req)
        # Loaded, it no longer holds the request's own promotions back.
        assert manager.lookup(tail, req) is PENDING
        assert manager.primary.slot_of(head) is None


async def test_a_request_s_hits_hold_back_its_own_promotions_only(engine_id):
    async with opened(engine_id, [scripted("others", instant=True)], chunks=1) as manager:
        head, tail = keys("others", 2)
        for key in (tail, head):
            fill(manager, [key])
            await settle(manager)
        assert manager.lookup(head, ReqContext("reader")) is HIT
        # Another request's promotion may take the slot: a lookup pins nothing, and a
        # host pins its hits before it looks up the next request's keys.
        assert manager.lookup(tail, ReqContext("other")) is PENDING
        assert manager.primary.slot_of(head) is None


async def promote_with_tier_held(manager, tier, prompts, requests) -> None:
    """Stored ``prompts`` out of the primary tier, each looked up by its request (all
    pending) and the step ended, while ``tier`` holds every job at its gate."""
    fill(manager, [key for prompt in prompts for key in prompt])
    await settle(manager)
    await manager.areset_cache()
    tier.gate.clear()
    for prompt, req in zip(prompts, requests, strict=True):
        assert [manager.lookup(k, req) for k in prompt] == [PENDING] * len(prompt)
    manager.on_schedule_end()
    await asyncio.sleep(0.01)


async def test_promotions_beyond_max_promotion_chunks_wait_their_turn_in_hit_order(engine_id):
    tier_config = scripted("paced", instant=True, max_promotion_chunks=3)
    async with opened(engine_id, [tier_config], chunks=12) as manager:
        tier = ScriptedTier.instances["paced"]
        prompts = [keys(f"paced-{i}", 3) for i in range(3)]
        requests = [ReqContext(f"r{i}") for i in range(3)]
        await promote_with_tier_held(manager, tier, prompts, requests)
        # One job on the tier; the others hold their slots and wait in the manager.
        assert [job.req_id for job in tier.load_jobs] == ["r0"]
        assert manager.has_pending_work()
        tier.gate.set()
        await settle(manager)
        # Each finished job let the next one go, without a scheduler step between.
        assert [job.req_id for job in tier.load_jobs] == ["r0", "r1", "r2"]
        for prompt, req in zip(prompts, requests, strict=True):
            assert [manager.lookup(k, req) for k in prompt] == [HIT] * 3
            manager.on_request_finished(req)


async def test_short_promotion_jobs_run_side_by_side_within_the_chunk_budget(engine_id):
    tier_config = scripted("short", instant=True, max_promotion_chunks=4)
    async with opened(engine_id, [tier_config], chunks=12) as manager:
        tier = ScriptedTier.instances["short"]
        prompts = [keys(f"short-{i}", 2) for i in range(3)]
        requests = [ReqContext(f"s{i}") for i in range(3)]
        await promote_with_tier_held(manager, tier, prompts, requests)
        # Two jobs of two chunks fill the budget of four; the third waits.
        assert [job.req_id for job in tier.load_jobs] == ["s0", "s1"]
        tier.gate.set()
        await settle(manager)
        assert [job.req_id for job in tier.load_jobs] == ["s0", "s1", "s2"]


async def let_one_job_through(manager, tier, count: int) -> None:
    """Once ``tier`` holds its ``count``-th load job at its gate, let that one through
    (the gate closes behind it) and wait for its outcome."""
    for _ in range(2000):
        if len(tier.load_jobs) >= count:
            break
        await asyncio.sleep(0.001)
    assert len(tier.load_jobs) == count
    tier.gate.set()
    tier.gate.clear()
    await manager.wait_for_completions()


async def test_the_first_admitted_request_s_chunks_all_become_readable_before_later_ones(
    engine_id,
):
    # A budget of two chunks: one job at a time, in the order the queue serves them.
    tier_config = scripted("turns", instant=True, max_promotion_chunks=2)
    async with opened(engine_id, [tier_config], chunks=12) as manager:
        tier = ScriptedTier.instances["turns"]
        prompts = {"a": keys("turn-a", 4), "b": keys("turn-b", 2), "c": keys("turn-c", 2)}
        requests = {name: ReqContext(name) for name in prompts}
        fill(manager, [key for prompt in prompts.values() for key in prompt])
        await settle(manager)
        await manager.areset_cache()
        tier.gate.clear()

        def look_up(name: str, part: slice) -> None:
            prompt, req = prompts[name][part], requests[name]
            assert [manager.lookup(key, req) for key in prompt] == [PENDING] * len(prompt)

        look_up("a", slice(0, 2))  # a's first step finds half its prompt
        manager.on_schedule_end()
        look_up("b", slice(None))
        look_up("c", slice(None))
        manager.on_schedule_end()
        look_up("a", slice(2, None))  # a step later, a finds the rest
        manager.on_schedule_end()

        readable: list[str] = []
        for count in range(1, 5):
            await let_one_job_through(manager, tier, count)
            for name, prompt in prompts.items():
                req = requests[name]
                if name not in readable and all(manager.lookup(k, req) is HIT for k in prompt):
                    readable.append(name)
        # a keeps its place in line for the rest of its prompt: it finishes first.
        assert readable == ["a", "b", "c"]
        assert [job.req_id for job in tier.load_jobs] == ["a", "a", "b", "c"]
        for req in requests.values():
            manager.on_request_finished(req)


async def test_a_request_finished_while_its_promotion_waits_frees_its_slots(engine_id):
    tier_config = scripted("waiting", instant=True, max_promotion_chunks=1)
    async with opened(engine_id, [tier_config], chunks=8) as manager:
        tier = ScriptedTier.instances["waiting"]
        first, second = keys("first", 2), keys("second", 2)
        requests = [ReqContext("a"), ReqContext("b")]
        await promote_with_tier_held(manager, tier, [first, second], requests)
        manager.on_request_finished(ReqContext("b"))  # still waiting: never sent
        tier.gate.set()
        await settle(manager)
        assert [job.req_id for job in tier.load_jobs] == ["a"]
        assert all(manager.primary.slot_of(key) is None for key in second)
        assert manager.primary.num_busy == 2  # a's chunks, kept until it loads
        assert not manager.has_pending_work()


async def test_a_finished_request_leaves_no_record_behind(engine_id):
    tiers = [scripted("asked"), {"type": "example"}]
    async with opened(engine_id, tiers, chunks=8, max_pending_s=60.0) as manager:
        stored, unknown = keys("stored", 2), keys("unknown", 2)
        fill(manager, stored)
        await settle(manager)
        await evict_all(manager, 8)
        manager.host.set_recompute_cost(1.0)
        req = ReqContext("everything")
        # Answers kept, a deadline running, promotions with a turn and sources, pins.
        assert [await resolve(manager, key, req) for key in stored] == [HIT, HIT]
        assert [await resolve(manager, key, req) for key in unknown] == [MISS, MISS]
        assert manager.host.pending_remaining_s(req) is not None
        assert manager.host.load_source(stored[0], req) == "2:example"
        manager.prepare_load(stored, req)
        out = manager.prepare_store(keys("written", 1), req)
        assert out is not None and manager.diagnostics.tracked_requests >= 1
        manager.on_request_finished(req)  # a store still in flight: the record waits
        assert manager.diagnostics.tracked_requests >= 1
        manager.complete_store(out.keys_to_store, req)
        manager.on_request_finished(WRITER)
        manager.on_request_finished(ReqContext("filler"))
        await settle(manager)
        assert manager.diagnostics.tracked_requests == 0
        assert manager.host.load_source(stored[0], req) is None
        assert manager.host.pending_remaining_s(req) is None
        # Nothing pins a slot for it any more: a store may take every slot.
        evicted = manager.prepare_store(keys("after", 8), ReqContext("after"))
        assert evicted is not None and len(evicted.keys_to_store) == 8


async def test_a_lookup_that_times_out_is_a_miss_counted_as_a_lookup_failure(engine_id):
    slow = scripted("slow", lookup_timeout_s=0.05)
    async with opened(engine_id, [slow], chunks=4) as manager:
        tier = ScriptedTier.instances["slow"]
        tier.gate.clear()  # the lookup never returns in time
        asked, answered = keys("asked", 2)
        reader = ReqContext("reader")
        assert await resolve(manager, asked, reader) is MISS
        tier.gate.set()
        assert await resolve(manager, answered, reader) is MISS  # answered: not there
        manager.on_schedule_end()
        stats = manager.diagnostics.tier_stats()[manager.diagnostics.tier_labels[0]]
        assert (stats["queries"], stats["lookup_failures"], stats["hits"]) == (2, 1, 0)


async def test_clearing_tiers_reports_those_that_failed_or_ran_past_their_timeout(engine_id):
    tiers = [
        scripted("clears"),
        scripted("breaks"),
        scripted("stalls", job_timeout_s=0.2, shutdown_grace_s=0.2),
    ]
    async with opened(engine_id, tiers, chunks=4) as manager:
        clears, breaks, stalls = (ScriptedTier.instances[n] for n in ("clears", "breaks", "stalls"))
        ks = keys("cleared", 2)
        fill(manager, ks)
        await settle(manager)
        assert all(set(tier.chunks) == set(ks) for tier in (clears, breaks, stalls))
        breaks.fail_clear = True
        stalls.gate.clear()
        started = asyncio.get_running_loop().time()
        kept = await asyncio.wait_for(manager.aclear_tiers(), 10)
        # The stalled clear was given up at its job timeout, not waited for.
        assert asyncio.get_running_loop().time() - started < 5
        assert kept == [breaks.ctx.tier_name, stalls.ctx.tier_name]
        assert clears.chunks == {} and clears.cleared
        assert set(breaks.chunks) == set(ks)
        assert not stalls.cleared
        # Let go, it ends on its own: the runner owns it until then (closing waits for it).
        stalls.gate.set()
        for _ in range(200):
            if stalls.cleared:
                break
            await asyncio.sleep(0.01)
        assert stalls.cleared and stalls.chunks == {}
