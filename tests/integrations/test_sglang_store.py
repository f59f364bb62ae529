"""kvtier's side of the SGLang backend, without SGLang: :class:`PageStore` called from
several threads, with pages in plain memory, over real tiers."""

from __future__ import annotations

import ctypes
import hashlib
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from scripted_tier import ScriptedTier

import kvtier.hosts.pages as pages_module
from kvtier import ConfigError
from kvtier.integrations.sglang import PageStore, Segment, offloading_config, page_key

PAGE_TOKENS = 16
#: Two segments per page, as SGLang's MHA pages come (K, then V).
HALF = 6000
PAGE_BYTES = 2 * HALF


def make_store(engine_id: str, kvtier: dict[str, Any], *, shard: str = "") -> PageStore:
    config = offloading_config(
        kvtier,
        engine_id=engine_id,
        page_tokens=PAGE_TOKENS,
        page_bytes=PAGE_BYTES,
        model_name="test-model",
        kv_format="torch.bfloat16;MHATokenToKVPoolHost;layout=page_first",
        shard=shard,
    )
    return PageStore(config)


def fs_tiers(root: Path, cpu_bytes: int = 1 << 20) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": cpu_bytes,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
    }


class Pages:
    """Page buffers in this process's memory, with their segments."""

    def __init__(self, count: int) -> None:
        self.buffers = [ctypes.create_string_buffer(PAGE_BYTES) for _ in range(count)]

    def segments(self) -> list[list[Segment]]:
        return [
            [(ctypes.addressof(buf), HALF), (ctypes.addressof(buf) + HALF, HALF)]
            for buf in self.buffers
        ]

    def fill(self, names: list[str]) -> None:
        for buf, name in zip(self.buffers, names, strict=True):
            ctypes.memmove(buf, contents(name), PAGE_BYTES)

    def holds(self, names: list[str]) -> list[bool]:
        return [buf.raw == contents(name) for buf, name in zip(self.buffers, names, strict=True)]


def contents(name: str) -> bytes:
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (PAGE_BYTES // len(seed) + 1))[:PAGE_BYTES]


def chain(count: int) -> list[str]:
    """Page hashes as SGLang names pages: 64 hex digits each."""
    base = uuid.uuid4().hex
    return [hashlib.sha256(f"{base}/{i}".encode()).hexdigest() for i in range(count)]


def test_pages_round_trip_through_the_fs_tier(engine_id, tmp_path):
    names = chain(10)
    keys = [page_key(n) for n in names]
    with make_store(engine_id, fs_tiers(tmp_path)) as store:
        source = Pages(10)
        source.fill(names)
        assert store.store(keys, source.segments(), 5.0) == [True] * 10
        store.manager.reset_cache()
        assert store.contains_prefix(keys, 5.0) == 10
        target = Pages(10)
        assert store.load(keys, target.segments(), 5.0) == [True] * 10
        assert target.holds(names) == [True] * 10


def test_a_prefix_ends_at_the_first_page_no_tier_holds(engine_id):
    names = chain(6)
    keys = [page_key(n) for n in names]
    with make_store(engine_id, {"cpu_bytes_to_use": 1 << 20}) as store:
        source = Pages(6)
        source.fill(names)
        store.store(keys[:3] + keys[4:], [*source.segments()[:3], *source.segments()[4:]], 5.0)
        assert store.contains_prefix(keys, 5.0) == 3
        target = Pages(6)
        assert store.load(keys, target.segments(), 5.0) == [True] * 3 + [False] * 3
        assert target.holds(names)[:3] == [True] * 3
        assert all(buf.raw == bytes(PAGE_BYTES) for buf in target.buffers[3:])


def test_threads_storing_and_loading_at_once_get_their_own_bytes(engine_id, tmp_path):
    # A primary tier of 24 pages for 4 threads of 16 pages: evictions and promotions
    # run under the threads' feet.
    row = -(-PAGE_BYTES // 4096) * 4096
    errors: list[BaseException] = []
    with make_store(engine_id, fs_tiers(tmp_path, cpu_bytes=24 * row)) as store:

        def worker() -> None:
            try:
                for _ in range(3):
                    names = chain(16)
                    keys = [page_key(n) for n in names]
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


def test_a_slow_tier_makes_a_load_return_by_its_timeout(engine_id):
    tag = f"slow-{uuid.uuid4().hex[:8]}"
    tiers = {
        "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [
            {"type": "ScriptedTier", "module_path": "scripted_tier", "tag": tag, "instant": True}
        ],
    }
    names = chain(3)
    keys = [page_key(n) for n in names]
    with make_store(engine_id, tiers) as store:
        source = Pages(3)
        source.fill(names)
        store.store(keys, source.segments(), 5.0)
        store.manager.reset_cache()
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
            started = time.monotonic()
            target = Pages(3)
            assert store.load(keys, target.segments(), 0.3) == [False] * 3
            assert time.monotonic() - started < 5
            assert all(buf.raw == bytes(PAGE_BYTES) for buf in target.buffers)
        finally:
            loop.run(release, timeout=5)


def test_a_prefix_never_loaded_lets_go_of_its_slots(engine_id, tmp_path, monkeypatch):
    monkeypatch.setattr(pages_module, "_SESSION_GRACE_S", 0.0)
    names = chain(4)
    keys = [page_key(n) for n in names]
    with make_store(engine_id, fs_tiers(tmp_path)) as store:
        source = Pages(4)
        source.fill(names)
        store.store(keys, source.segments(), 5.0)
        store.manager.reset_cache()
        assert store.contains_prefix(keys, 0.05) == 4
        while store.manager.has_pending_work():
            time.sleep(0.01)
        primary = store.manager.primary
        assert primary.num_busy == 4  # promoted and kept for the load that never came
        time.sleep(0.2)
        store.contains_prefix([], 0.05)  # any later lookup ends the lapsed session
        assert primary.num_busy == 0


def test_shards_and_formats_are_separate_namespaces(engine_id):
    one = offloading_config(
        {"cpu_bytes_to_use": 1 << 20},
        engine_id=engine_id,
        page_tokens=PAGE_TOKENS,
        page_bytes=PAGE_BYTES,
        model_name="m",
        kv_format="torch.bfloat16;MHA;layout=page_first",
        shard="tp0of2",
    )
    assert one.model_name == "m@tp0of2"
    assert one.extra_config["block_size"] == PAGE_TOKENS
    assert one.extra_config["spec_name"] == "CPUOffloadingSpec"
    tiered = offloading_config(
        {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": []},
        engine_id=engine_id,
        page_tokens=PAGE_TOKENS,
        page_bytes=PAGE_BYTES,
        model_name="m",
        kv_format="x",
    )
    assert tiered.extra_config["spec_name"] == "TieringOffloadingSpec"


def test_a_chunk_size_other_than_the_page_is_refused(engine_id):
    with pytest.raises(ConfigError, match=r"kvtier\.block_size"):
        offloading_config(
            {"cpu_bytes_to_use": 1 << 20, "block_size": 2 * PAGE_TOKENS},
            engine_id=engine_id,
            page_tokens=PAGE_TOKENS,
            page_bytes=PAGE_BYTES,
            model_name="m",
            kv_format="x",
        )


def test_calls_after_close_are_misses(engine_id):
    names = chain(2)
    keys = [page_key(n) for n in names]
    store = make_store(engine_id, {"cpu_bytes_to_use": 1 << 20})
    store.close()
    store.close()
    pages = Pages(2)
    assert store.contains_prefix(keys, 1.0) == 0
    assert store.load(keys, pages.segments(), 1.0) == [False, False]
    assert store.store(keys, pages.segments(), 1.0) == [False, False]


def test_page_keys_are_sglang_hashes_as_bytes():
    page_hash = "ab" * 32
    assert page_key(page_hash) == bytes.fromhex(page_hash) + bytes(4)
    assert page_key("not-hex") == b"not-hex" + bytes(4)
