"""KVTier: the await-based facade over the manager and one worker."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import keys, make_config, scripted, tiering_config
from kvtier_cli import kvtier
from scripted_tier import ScriptedTier

from kvtier import KVTier, ReqContext
from kvtier.errors import KVTierError
from kvtier.region import region_path
from kvtier.worker import ThreadedCopyEngine

pytestmark = pytest.mark.anyio

BLOCK = 4096


def cache(seed=0, blocks=64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 255, (blocks, BLOCK), dtype=torch.uint8, generator=gen)


def example_config(engine_id, chunks=8, **extra):
    return tiering_config(engine_id, [{"type": "example"}], chunks=chunks, **extra)


async def test_store_lookup_load_round_trip(engine_id):
    kv_cache = cache()
    async with KVTier(example_config(engine_id), [kv_cache]) as kv:
        ks = keys("facade", 4)
        assert await kv.store(ks, [0, 1, 2, 3], "w") == 4
        assert await kv.store(ks, [0, 1, 2, 3], "w") == 0  # already stored
        assert await kv.lookup(ks, "r") == 4
        assert await kv.load(ks, [10, 11, 12, 13], "r") == 4
        assert torch.equal(kv_cache[10:14], kv_cache[0:4])


async def test_lookup_counts_leading_keys_and_stops_at_the_first_miss(engine_id):
    async with KVTier(example_config(engine_id), [cache()]) as kv:
        a, b, c = keys("prefix", 3)
        await kv.store([a, c], [0, 1], "w")
        assert await kv.lookup([a, b, c], "r") == 1
        kv.finish("r")


async def test_chunks_come_back_from_a_secondary_tier_after_eviction(engine_id):
    kv_cache = cache()
    async with KVTier(example_config(engine_id, chunks=4), [kv_cache]) as kv:
        first = keys("early", 4)
        await kv.store(first, [0, 1, 2, 3], "w1")
        await kv.drain()
        await kv.store(keys("late", 4), [4, 5, 6, 7], "w2")
        await kv.drain()
        assert kv.manager.host.readable_prefix(first) == 0
        assert await kv.lookup(first, "r", timeout=10) == 4
        assert await kv.load(first, [20, 21, 22, 23], "r") == 4
        assert torch.equal(kv_cache[20:24], kv_cache[0:4])


async def test_a_long_prefix_is_pinned_as_it_is_promoted_so_it_cannot_thrash(engine_id):
    async with KVTier(example_config(engine_id, chunks=4), [cache()]) as kv:
        long_prefix = keys("long", 6)
        for i in range(0, 6, 2):
            await kv.store(long_prefix[i : i + 2], [i, i + 1], f"w{i}")
            await kv.drain()
        await kv.reset()
        found = await kv.lookup(long_prefix, "r", timeout=10)
        assert found == 4  # what fits, held; the rest found no slot
        assert await kv.load(long_prefix[:found], [30, 31, 32, 33], "r") == 4


async def test_lookup_returns_within_its_timeout_when_a_tier_does_not_answer(engine_id):
    config = tiering_config(engine_id, [scripted("silent")], chunks=4)
    async with KVTier(config, [cache()]) as kv:
        tier = ScriptedTier.instances["silent"]
        tier.gate.clear()
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await kv.lookup(keys("nothing", 2), "r", timeout=0.2) == 0
        assert loop.time() - started < 5
        kv.finish("r")
        tier.gate.set()


async def test_shutdown_does_not_hang_on_a_tier_that_never_returns(engine_id):
    tier_config = scripted("hung", lookup_timeout_s=0.05, job_timeout_s=0.05, shutdown_grace_s=0.1)
    config = tiering_config(engine_id, [tier_config], chunks=4)
    async with KVTier(config, [cache()]) as kv:
        tier = ScriptedTier.instances["hung"]
        tier.gate.clear()
        tier.ignore_cancel = False
        assert await kv.lookup(keys("never", 1), "r", timeout=1) == 0
        kv.finish("r")
    assert tier.closed


async def test_a_store_finishes_even_when_its_caller_is_cancelled(engine_id):
    gate = threading.Event()
    async with KVTier(
        example_config(engine_id), [cache()], engine=ThreadedCopyEngine(gate=gate)
    ) as kv:
        ks = keys("cancelled", 2)
        task = asyncio.ensure_future(kv.store(ks, [3, 4], "w"))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await kv.drain()
        assert kv.manager.host.readable_prefix(ks) == 2


async def test_a_store_with_no_room_waits_for_cascades_then_stores(engine_id):
    config = tiering_config(engine_id, [scripted("busy")], chunks=2)
    async with KVTier(config, [cache()]) as kv:
        tier = ScriptedTier.instances["busy"]
        tier.gate.clear()
        assert await kv.store(keys("first", 2), [0, 1], "w1") == 2  # both now pinned
        waiting = asyncio.ensure_future(kv.store(keys("second", 2), [2, 3], "w2"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        tier.gate.set()
        assert await asyncio.wait_for(waiting, 10) == 2


async def test_store_gives_up_when_nothing_could_free_a_slot(engine_id):
    async with KVTier(make_config(engine_id, cpu_bytes_to_use=2 * BLOCK), [cache()]) as kv:
        pinned = keys("pinned", 2)
        await kv.store(pinned, [0, 1], "w")
        assert await kv.lookup(pinned, "holder") == 2  # pinned until loaded or finished
        assert await kv.store(keys("more", 1), [2], "w2", timeout=5) == 0
        kv.finish("holder")
        assert await kv.store(keys("more", 1), [2], "w2") == 1


async def test_bad_block_ids_are_rejected(engine_id):
    async with KVTier(example_config(engine_id), [cache()]) as kv:
        with pytest.raises(ValueError, match="need 2 gpu_block_ids"):
            await kv.store(keys("bad", 2), [1], "w")


async def test_a_closed_or_unopened_facade_says_so(engine_id):
    kv = KVTier(example_config(engine_id), [cache()])
    with pytest.raises(KVTierError, match="not open"):
        await kv.lookup(keys("x", 1), "r")
    await kv.aclose()


async def test_open_and_aclose_release_everything(engine_id):
    kv = await KVTier.open(example_config(engine_id), [cache()])
    await kv.store(keys("bye", 2), [0, 1], "w")
    await kv.aclose()
    await kv.aclose()
    assert not region_path(engine_id).exists()
    assert kv.manager.region.closed


async def test_cpu_spec_works_behind_the_facade_too(engine_id):
    kv_cache = cache()
    async with KVTier(make_config(engine_id, cpu_bytes_to_use=8 * BLOCK), [kv_cache]) as kv:
        ks = keys("cpu", 3)
        assert await kv.store(ks, [0, 1, 2], "w") == 3
        assert await kv.lookup(ks, "r") == 3
        assert await kv.load(ks, [5, 6, 7], "r") == 3
        assert torch.equal(kv_cache[5:8], kv_cache[0:3])


def test_the_example_host_runs(tmp_path):
    script = Path(__file__).parent.parent / "examples" / "async_host.py"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "round 2 user 7: 16 of 16 chunks cached" in result.stdout
    # What the command-line reference (docs/reference/cli.md) says to do next: inspect the
    # fs tier the example left behind.
    inspected = kvtier("inspect", str(tmp_path), "--json")
    assert inspected.returncode == 0, inspected.stderr
    [namespace] = json.loads(inspected.stdout)
    assert namespace["chunks"] > 0
    assert ";model=example-model;dtype=uint8;" in namespace["namespace"]


# ------------------------------------------------- reset, finish and close races


async def test_a_lookup_during_a_reset_never_pins_a_slot_the_reset_frees(engine_id):
    kv_cache = cache()
    config = tiering_config(engine_id, [scripted("slow")], chunks=4)
    async with KVTier(config, [kv_cache]) as kv:
        tier = ScriptedTier.instances["slow"]
        first = keys("reset-race", 2)
        await kv.store(first, [0, 1], "w1")
        await kv.drain()
        tier.gate.clear()
        await kv.store(keys("in-flight", 1), [2], "w2")  # its cascade holds the reset
        resetting = asyncio.ensure_future(kv.reset())
        await asyncio.sleep(0.05)
        assert not resetting.done()
        looking = asyncio.ensure_future(kv.lookup(first, "r", timeout=10))
        await asyncio.sleep(0.05)
        tier.gate.set()
        await resetting
        assert await looking == 2  # promoted back from the tier after the reset
        assert await kv.store(keys("after", 2), [10, 11], "w3") == 2  # takes the free slots
        assert await kv.load(first, [20, 21], "r") == 2
        assert torch.equal(kv_cache[20:22], kv_cache[0:2])
        kv.finish("r")


async def test_a_reset_waits_for_a_load_in_flight_which_copies_the_right_bytes(engine_id):
    kv_cache = cache()
    gate = threading.Event()
    gate.set()
    engine = ThreadedCopyEngine(gate=gate)
    async with KVTier(example_config(engine_id), [kv_cache], engine=engine) as kv:
        ks = keys("load-reset", 2)
        await kv.store(ks, [0, 1], "w")
        assert await kv.lookup(ks, "r") == 2
        gate.clear()
        loading = asyncio.ensure_future(kv.load(ks, [30, 31], "r"))
        await asyncio.sleep(0.05)
        resetting = asyncio.ensure_future(kv.reset())
        await asyncio.sleep(0.05)
        assert not resetting.done()
        gate.set()
        assert await loading == 2
        await resetting
        assert torch.equal(kv_cache[30:32], kv_cache[0:2])
        assert kv.manager.host.readable_prefix(ks) == 0


async def test_a_request_finished_while_its_lookup_waits_keeps_no_pin(engine_id):
    config = tiering_config(engine_id, [scripted("later")], chunks=4)
    async with KVTier(config, [cache()]) as kv:
        tier = ScriptedTier.instances["later"]
        prefix = keys("abandoned", 4)
        await kv.store(prefix, [0, 1, 2, 3], "w1")
        await kv.drain()
        await kv.reset()
        await kv.store(prefix[:1], [0], "w2")  # the head is resident again, the rest is not
        await kv.drain()
        tier.gate.clear()
        looking = asyncio.ensure_future(kv.lookup(prefix, "r"))
        await asyncio.sleep(0.05)
        kv.finish("r")
        tier.gate.set()
        assert await asyncio.wait_for(looking, 10) == 0
        await kv.drain()
        assert kv.manager.primary.num_busy == 0  # nothing pinned, nothing being written


async def test_every_call_on_a_closed_facade_raises_and_none_hangs(engine_id):
    tier_config = scripted("mute", lookup_timeout_s=0.2, job_timeout_s=0.2, shutdown_grace_s=0.2)
    kv = await KVTier.open(tiering_config(engine_id, [tier_config], chunks=4), [cache()])
    tier = ScriptedTier.instances["mute"]
    ks = keys("closed", 2)
    await kv.store(ks, [0, 1], "w")
    await kv.drain()
    tier.gate.clear()
    waiting = asyncio.ensure_future(kv.lookup(keys("on-disk", 2), "r"))  # no timeout
    await asyncio.sleep(0.05)
    await asyncio.wait_for(kv.aclose(), 10)
    with pytest.raises(KVTierError, match="closed"):
        await asyncio.wait_for(waiting, 10)
    tier.gate.set()
    calls = [
        kv.lookup(ks, "r"),
        kv.lookup(keys("on-disk", 2), "r2"),
        kv.load(ks, [5, 6], "r"),
        kv.store(ks, [0, 1], "w"),
        kv.reset(),
        kv.drain(),
    ]
    for call in calls:
        with pytest.raises(KVTierError, match="this KVTier is closed"):
            await asyncio.wait_for(call, 5)
    with pytest.raises(KVTierError, match="this KVTier is closed"):
        kv.finish("r")


async def test_aclose_closes_everything_even_when_a_tier_fails_to_close(engine_id, caplog):
    config = tiering_config(engine_id, [scripted("stubborn", fail_close=True)], chunks=4)
    kv = await KVTier.open(config, [cache()])
    await kv.store(keys("stubborn", 2), [0, 1], "w")
    await kv.aclose()
    assert ScriptedTier.instances["stubborn"].closed
    assert kv.manager.region.closed and not region_path(engine_id).exists()
    assert any("failed to close" in record.getMessage() for record in caplog.records)


# ------------------------------------------------------------- the serving path


async def test_a_prompt_half_evicted_to_disk_reads_back_only_its_missing_chunks(
    engine_id, tmp_path
):
    kv_cache = cache(blocks=96)
    config = tiering_config(engine_id, [{"type": "fs", "root_dir": str(tmp_path)}], chunks=40)
    async with KVTier(config, [kv_cache]) as kv:
        first, second = keys("first-prompt", 28), keys("second-prompt", 28)
        assert await kv.store(first, list(range(28)), "w1") == 28
        await kv.drain()
        assert await kv.store(second, list(range(28, 56)), "w2") == 28
        await kv.drain()
        # It lost its tail to make room, never its head.
        assert kv.manager.host.readable_prefix(first) == 12
        assert await kv.lookup(first, "r", timeout=30) == 28
        assert await kv.load(first, list(range(60, 88)), "r") == 28
        assert torch.equal(kv_cache[60:88], kv_cache[0:28])
        kv.manager.on_schedule_end()
        chunk = kv.manager.region.chunk_bytes
        read = kv.manager.diagnostics.tier_stats()["1:fs"]["bytes_read"]
        assert round(read / chunk) == 16  # only the 16 chunks that had left the primary
        scraped = kv.registry.get_sample_value("kvtier_tiering_read_bytes_total", {"tier": "1:fs"})
        assert scraped == read


async def test_a_lookup_answered_from_the_primary_tier_is_counted_in_the_metrics(engine_id):
    async with KVTier(example_config(engine_id), [cache()]) as kv:
        ks = keys("counted", 3)
        await kv.store(ks, [0, 1, 2], "w")
        assert await kv.lookup(ks, "r") == 3
        kv.finish("r")
        hits = kv.registry.get_sample_value(
            "kvtier_tiering_chunk_hits_total", {"tier": "0:primary"}
        )
    assert hits == 3


async def test_chunks_still_on_their_way_at_the_lookup_timeout_are_misses_for_it(engine_id):
    config = tiering_config(engine_id, [scripted("late", instant=True)], chunks=4)
    async with KVTier(config, [cache()]) as kv:
        ks = keys("deadline", 2)
        await kv.store(ks, [0, 1], "w")
        await kv.drain()
        await kv.reset()
        ScriptedTier.instances["late"].gate.clear()
        assert await kv.lookup(ks, "r", timeout=0.2) == 0
        ScriptedTier.instances["late"].gate.set()
        await kv.drain()
        # The promotion landed, but the request went on without it: nothing kept for it.
        assert kv.manager.primary.num_busy == 0
        # Readable now, they are hits for anyone who asks, that request included.
        assert await kv.lookup(ks, "other") == 2
        assert await kv.lookup(ks, "r") == 2
        kv.finish("r")
        kv.finish("other")


async def test_a_request_waits_for_a_prefix_another_request_claimed_to_compute(engine_id):
    async with KVTier(example_config(engine_id), [cache()]) as kv:
        prefix = keys("shared", 3)
        assert await kv.lookup(prefix, "first", claim=True) == 0  # it computes them
        second = asyncio.ensure_future(kv.lookup(prefix, "second", timeout=30))
        await asyncio.sleep(0.05)
        assert not second.done()  # waiting for the first request's chunks
        assert await kv.store(prefix, [0, 1, 2], "first") == 3
        assert await asyncio.wait_for(second, 10) == 3  # computed once, reused
        kv.finish("first")
        kv.finish("second")


async def test_a_claim_ends_with_its_request_and_never_makes_claimers_wait(engine_id):
    async with KVTier(example_config(engine_id), [cache()]) as kv:
        prefix, other = keys("claimed", 2), keys("mine", 2)
        assert await kv.lookup(prefix, "first", claim=True) == 0
        # A request holding claims of its own does not wait for another's.
        assert await kv.lookup(other, "second", claim=True) == 0
        assert await asyncio.wait_for(kv.lookup(prefix, "second"), 5) == 0
        waiting = asyncio.ensure_future(kv.lookup(prefix, "third", timeout=30))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        kv.finish("first")  # gave up without storing: the waiter recomputes
        assert await asyncio.wait_for(waiting, 10) == 0
        # Without a claim nobody waits at all, and a timeout bounds the wait.
        assert await kv.lookup(prefix, "fourth", claim=True) == 0
        assert await kv.lookup(prefix, "fifth", timeout=0.1) == 0
        for req in ("second", "third", "fourth", "fifth"):
            kv.finish(req)


async def test_a_lookup_waiting_for_a_claim_answers_0_when_a_reset_begins(engine_id):
    async with KVTier(example_config(engine_id), [cache()]) as kv:
        prefix = keys("claimed-reset", 3)
        assert await kv.store(prefix[:1], [0], "writer") == 1
        assert await kv.lookup(prefix, "first", claim=True) == 1  # computes the rest
        waiting = asyncio.ensure_future(kv.lookup(prefix, "second", timeout=30))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # its first key found, waiting for the claimed ones
        await kv.reset()
        assert await asyncio.wait_for(waiting, 10) == 0
        assert kv.manager.host.held(ReqContext("second")) == {}


async def test_claiming_keys_past_a_lookup_makes_others_wait_for_them_too(engine_id):
    async with KVTier(example_config(engine_id), [cache()]) as kv:
        prefix = keys("long", 4)
        assert await kv.lookup(prefix[:2], "first", claim=True) == 0
        assert kv.claim(prefix, "first") == 2  # the two after the looked-up window
        assert kv.claim(prefix, "second") == 0  # the first request's, not its own
        waiting = asyncio.ensure_future(kv.lookup(prefix[2:], "second", timeout=30))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert await kv.store(prefix, [0, 1, 2, 3], "first") == 4
        assert await asyncio.wait_for(waiting, 10) == 2
        kv.finish("first")
        assert kv.claim(prefix, "first") == 0  # a finished request claims nothing
        kv.finish("second")
    with pytest.raises(KVTierError, match="closed"):
        kv.claim(prefix, "third")


async def in_the_tier_only(kv: KVTier, prefix: str, count: int) -> list:
    """``count`` keys stored, cascaded to the tier, then emptied from the primary tier."""
    ks = keys(prefix, count)
    await kv.store(ks, list(range(count)), "w")
    await kv.drain()
    await kv.reset()
    return ks


async def test_a_lookup_gives_a_tier_not_measured_yet_a_tenth_of_the_recompute(engine_id):
    config = tiering_config(engine_id, [scripted("unmeasured", instant=True)], chunks=4)
    async with KVTier(config, [cache()]) as kv:
        ks = await in_the_tier_only(kv, "probed", 2)
        tier = ScriptedTier.instances["unmeasured"]
        tier.gate.clear()  # the tier has become a link that does not deliver
        try:
            kv.recompute_s_per_chunk = 10.0
            started = time.monotonic()
            # Recomputing both chunks takes 20 s; a probe may cost a tenth of that.
            assert await asyncio.wait_for(kv.lookup(ks, "r", timeout=600), 30) == 0
            assert time.monotonic() - started < 10
        finally:
            tier.gate.set()
        kv.finish("r")
        await kv.drain()
        # The promotion went on: the tier is measured, and the next request waits for
        # it as long as recomputing would take (the chunks landed meanwhile).
        assert await kv.lookup(ks, "next", timeout=600) == 2
        kv.finish("next")


async def test_a_lookup_waits_no_longer_than_recomputing_its_chunks_would_take(engine_id):
    config = tiering_config(engine_id, [scripted("stuck", instant=True)], chunks=4)
    async with KVTier(config, [cache()]) as kv:
        ks = await in_the_tier_only(kv, "bounded", 3)
        assert await kv.lookup(ks[:1], "measure") == 1  # the tier is measured now
        kv.finish("measure")
        kv.recompute_s_per_chunk = 0.1
        tier = ScriptedTier.instances["stuck"]
        tier.gate.clear()  # the promotion never ends
        try:
            # Not the 600 s asked: the 0.2 s recomputing both chunks takes.
            assert await asyncio.wait_for(kv.lookup(ks[1:], "r", timeout=600), 30) == 0
        finally:
            tier.gate.set()
        kv.finish("r")


async def test_the_facade_tells_its_size_and_takes_the_recompute_cost(engine_id):
    async with KVTier(example_config(engine_id, chunks=8), [cache()]) as kv:
        assert kv.num_chunks == 8
        assert kv.recompute_s_per_chunk is None
        kv.recompute_s_per_chunk = 0.5
        assert kv.recompute_s_per_chunk == 0.5
        with pytest.raises(ValueError, match="seconds_per_chunk"):
            kv.recompute_s_per_chunk = -1.0
