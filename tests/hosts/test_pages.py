"""PageStore: kvtier's tiers as a store of pages in the caller's memory, called from
several threads, over real tiers."""

from __future__ import annotations

import ctypes
import hashlib
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import make_config
from page_buffers import HALF, PAGE_BYTES, Pages, contents
from scripted_tier import ScriptedTier

import kvtier.hosts.pages as pages_module
from kvtier import ConfigError, OffloadingConfig, OffloadKey, make_offload_key
from kvtier.hosts import PageStore

ROW = -(-PAGE_BYTES // 4096) * 4096


def config(
    engine_id: str, *, rows: int = 64, tiers: list[dict[str, Any]] | None = None
) -> OffloadingConfig:
    extra: dict[str, Any] = {"cpu_bytes_to_use": rows * ROW}
    if tiers is not None:
        extra |= {"spec_name": "TieringOffloadingSpec", "secondary_tiers": tiers}
    return make_config(engine_id, kv_bytes_per_block=PAGE_BYTES, **extra)


def fs(root: Path) -> list[dict[str, Any]]:
    return [{"type": "fs", "root_dir": str(root)}]


def chain(count: int) -> tuple[list[str], list[OffloadKey]]:
    base = uuid.uuid4().hex
    names = [f"{base}/{i}" for i in range(count)]
    return names, [make_offload_key(hashlib.sha256(n.encode()).digest()) for n in names]


def test_pages_round_trip_through_the_fs_tier(engine_id, tmp_path):
    names, keys = chain(10)
    with PageStore(config(engine_id, tiers=fs(tmp_path))) as store:
        source = Pages(10)
        source.fill(names)
        assert store.store(keys, source.segments(), 5.0) == [True] * 10
        store.reset()
        assert store.contains_prefix(keys, 5.0) == 10
        target = Pages(10)
        assert store.load(keys, target.segments(), 5.0) == [True] * 10
        assert target.holds(names) == [True] * 10
        assert store.stats() == {
            "queried": 10,
            "found": 10,
            "loaded": 10,
            "load_misses": 0,
            "stored": 10,
            "already_stored": 0,
            "store_failures": 0,
        }


def test_a_prefix_found_and_loaded_counts_each_page_once_per_tier(engine_id, tmp_path):
    # contains_prefix and the load that follows are one request: the load's lookups of
    # the same pages count nothing more; the next contains_prefix is a new request.
    names, keys = chain(6)
    with PageStore(config(engine_id, tiers=fs(tmp_path))) as store:
        source = Pages(6)
        source.fill(names)
        assert store.store(keys, source.segments(), 5.0) == [True] * 6
        store.reset()
        assert store.contains_prefix(keys, 5.0) == 6
        assert store.load(keys, Pages(6).segments(), 5.0) == [True] * 6
        stats = store.manager.diagnostics.tier_stats()
        assert (stats["0:primary"]["queries"], stats["0:primary"]["hits"]) == (6, 0)
        assert (stats["1:fs"]["queries"], stats["1:fs"]["hits"]) == (6, 6)
        assert store.contains_prefix(keys, 5.0) == 6
        stats = store.manager.diagnostics.tier_stats()
        assert (stats["0:primary"]["queries"], stats["0:primary"]["hits"]) == (12, 6)


def test_a_prefix_ends_at_the_first_page_no_tier_holds(engine_id):
    names, keys = chain(6)
    with PageStore(config(engine_id)) as store:
        source = Pages(6)
        source.fill(names)
        store.store(keys[:3] + keys[4:], [*source.segments()[:3], *source.segments()[4:]], 5.0)
        assert store.contains_prefix(keys, 5.0) == 3
        target = Pages(6)
        assert store.load(keys, target.segments(), 5.0) == [True] * 3 + [False] * 3
        assert target.holds(names)[:3] == [True] * 3
        assert all(buf.raw == bytes(PAGE_BYTES) for buf in target.buffers[3:])


def test_a_page_stored_already_counts_as_stored(engine_id):
    names, keys = chain(3)
    with PageStore(config(engine_id)) as store:
        source = Pages(3)
        source.fill(names)
        assert store.store(keys[:2], source.segments()[:2], 5.0) == [True, True]
        assert store.store(keys, source.segments(), 5.0) == [True] * 3
        stats = store.stats()
        assert (stats["stored"], stats["already_stored"]) == (3, 2)


def test_a_store_larger_than_the_primary_tier_keeps_what_found_room(engine_id, tmp_path):
    # Batches of half the tier: each cascades to disk and makes room for the next.
    names, keys = chain(20)
    with PageStore(config(engine_id, rows=8, tiers=fs(tmp_path))) as store:
        source = Pages(20)
        source.fill(names)
        assert store.store(keys, source.segments(), 30.0) == [True] * 20
        for first in range(0, 20, 4):  # every page reached the disk
            store.reset()
            assert store.contains_prefix(keys[first : first + 4], 30.0) == 4


def test_threads_storing_and_loading_at_once_get_their_own_bytes(engine_id, tmp_path):
    # A primary tier of 24 pages for 4 threads of 16 pages: evictions and promotions
    # run under the threads' feet.
    errors: list[BaseException] = []
    with PageStore(config(engine_id, rows=24, tiers=fs(tmp_path))) as store:

        def worker() -> None:
            try:
                for _ in range(3):
                    names, keys = chain(16)
                    source = Pages(16)
                    source.fill(names)
                    assert all(store.store(keys, source.segments(), 10.0))
                    found = store.contains_prefix(keys, 10.0)
                    target = Pages(found)
                    done = store.load(keys[:found], target.segments(), 10.0)
                    # Whatever arrived holds its own bytes; the rest is untouched.
                    for ok, buf, name in zip(done, target.buffers, names, strict=False):
                        assert buf.raw == (contents(name) if ok else bytes(PAGE_BYTES))
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def test_a_load_never_evicts_a_page_it_found_to_promote_a_later_one(engine_id, tmp_path):
    # One row: the first page holds it, the second is on disk only. Promoting the
    # second would take the first's row between finding and pinning it.
    names, keys = chain(2)
    with PageStore(config(engine_id, rows=1, tiers=fs(tmp_path))) as store:
        source = Pages(2)
        source.fill(names)
        for index in (1, 0):  # the second page reaches the disk and leaves the row
            assert store.store(keys[index : index + 1], source.segments()[index : index + 1], 5.0)
        loop = store.manager.loop
        assert loop is not None
        loop.run(store.manager.drain, timeout=5)  # the first page's cascade unpins it
        target = Pages(2)
        assert store.load(keys, target.segments(), 5.0) == [True, False]
        assert target.holds(names) == [True, False]


def test_a_slow_tier_makes_a_load_return_by_its_timeout(engine_id):
    tag = f"slow-{uuid.uuid4().hex[:8]}"
    tiers = [{"type": "ScriptedTier", "module_path": "scripted_tier", "tag": tag, "instant": True}]
    names, keys = chain(3)
    with PageStore(config(engine_id, tiers=tiers)) as store:
        source = Pages(3)
        source.fill(names)
        store.store(keys, source.segments(), 5.0)
        store.reset()
        tier = ScriptedTier.instances[tag]
        loop = store.manager.loop
        assert loop is not None

        async def hold() -> None:
            tier.gate.clear()

        async def release() -> None:
            tier.gate.set()

        loop.run(hold, timeout=5)
        try:
            assert store.contains_prefix(keys, 5.0) == 3  # answered from memory
            target = Pages(3)
            # Returns (the test's timeout would fail it otherwise) with nothing copied.
            assert store.load(keys, target.segments(), 0.3) == [False] * 3
            assert all(buf.raw == bytes(PAGE_BYTES) for buf in target.buffers)
        finally:
            loop.run(release, timeout=5)


def test_a_prefix_never_loaded_lets_go_of_its_slots(engine_id, tmp_path, monkeypatch):
    monkeypatch.setattr(pages_module, "_SESSION_GRACE_S", 0.0)
    names, keys = chain(4)
    with PageStore(config(engine_id, tiers=fs(tmp_path))) as store:
        source = Pages(4)
        source.fill(names)
        store.store(keys, source.segments(), 5.0)
        store.reset()
        assert store.contains_prefix(keys, 0.05) == 4
        while store.manager.has_pending_work():
            time.sleep(0.01)
        primary = store.manager.primary
        assert primary.num_busy == 4  # promoted and kept for the load that never came
        time.sleep(0.2)
        store.contains_prefix([], 0.05)  # any later lookup ends the lapsed request
        assert primary.num_busy == 0


def test_the_tiers_hear_of_requests_by_the_hosts_prefix(engine_id):
    tag = f"names-{uuid.uuid4().hex[:8]}"
    tiers = [{"type": "ScriptedTier", "module_path": "scripted_tier", "tag": tag}]
    names, keys = chain(1)
    with PageStore(config(engine_id, tiers=tiers), request_prefix="engine") as store:
        source = Pages(1)
        source.fill(names)
        store.store(keys, source.segments(), 5.0)
        while store.manager.has_pending_work():
            time.sleep(0.01)
        assert ScriptedTier.instances[tag].finished_requests == ["engine-0"]


def test_size_and_recompute_cost_are_the_stores_own(engine_id):
    with PageStore(config(engine_id, rows=16)) as store:
        assert store.num_chunks == 16
        assert store.recompute_s_per_chunk is None
        store.recompute_s_per_chunk = 0.25
        assert store.recompute_s_per_chunk == 0.25
        with pytest.raises(ValueError, match="seconds_per_chunk"):
            store.recompute_s_per_chunk = 0


def test_a_page_of_the_wrong_size_is_refused(engine_id):
    _, keys = chain(1)
    with PageStore(config(engine_id)) as store:
        buffer = ctypes.create_string_buffer(PAGE_BYTES)
        with pytest.raises(ValueError, match="page 0 has"):
            store.store(keys, [[(ctypes.addressof(buffer), HALF)]], 1.0)


def test_a_store_of_more_than_one_rank_is_refused(engine_id):
    with pytest.raises(ConfigError, match="world_size"):
        PageStore(make_config(engine_id, kv_bytes_per_block=PAGE_BYTES, world_size=2))


def test_calls_after_close_are_misses(engine_id):
    _, keys = chain(2)
    store = PageStore(config(engine_id))
    store.close()
    store.close()
    assert store.closed
    pages = Pages(2)
    assert store.contains_prefix(keys, 1.0) == 0
    assert store.load(keys, pages.segments(), 1.0) == [False, False]
    assert store.store(keys, pages.segments(), 1.0) == [False, False]
    assert store.clear() == []
