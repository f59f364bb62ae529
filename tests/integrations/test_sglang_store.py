"""kvtier's side of the SGLang backend, without SGLang: SGLang's page names as keys,
its settings as a configuration, and a PageStore built from them (the store itself is
specified in tests/hosts/test_pages.py)."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Any

import pytest
from page_buffers import PAGE_BYTES, Pages

from kvtier import ConfigError
from kvtier.integrations.sglang import PageStore, offloading_config, page_key

PAGE_TOKENS = 16


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


def test_page_keys_are_sglang_hashes_as_bytes():
    page_hash = "ab" * 32
    assert page_key(page_hash) == bytes.fromhex(page_hash) + bytes(4)
    assert page_key("not-hex") == b"not-hex" + bytes(4)
