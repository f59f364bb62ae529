"""The rest of SGLang's backend interface: single-page calls, layouts, statistics,
clear and close, and what the backend refuses while SGLang attaches it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
from sglang_host import Geometry, HiCacheHost, kvtier_extra_config, open_host, page_contents
from sglang_procs import MIB, fs_config

from kvtier import ConfigError
from kvtier.hosts import Step, step_until_blocking
from kvtier.integrations.sglang import KVTierHiCacheStorage, UnsupportedPoolError


def storage_config(kvtier: dict[str, Any], **fields: Any) -> HiCacheStorageConfig:
    values: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": True,
        "model_name": "api-model",
        "extra_config": kvtier_extra_config(kvtier),
    }
    values.update(fields)
    return HiCacheStorageConfig(**values)


@pytest.fixture
def backends(hosts):
    """Backends a test builds on a host's pool; closed when it ends."""
    built: list[KVTierHiCacheStorage] = []
    yield built
    for backend in built:
        backend.close()


def direct_backend(
    backends: list[KVTierHiCacheStorage], host: HiCacheHost, kvtier: dict[str, Any], **fields: Any
) -> KVTierHiCacheStorage:
    backend = KVTierHiCacheStorage(storage_config(kvtier, **fields), {})
    backends.append(backend)
    backend.register_mem_pool_host(host.host_pool)
    backend.on_host_pools_registered()
    return backend


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "generic"])
def test_layer_first_pages_round_trip(hosts, tokens_of, zero_copy):
    host = open_host(
        hosts,
        {"cpu_bytes_to_use": 4 * MIB},
        zero_copy=zero_copy,
        geometry=Geometry(layout="layer_first"),
    )
    tokens = tokens_of(6, host.geometry.page_tokens)
    assert host.backup(tokens) == len(tokens)
    hit, completed, indices = host.prefetch(tokens, scribble=True)
    assert (hit, completed) == (len(tokens), len(tokens))
    assert all(host.matching_pages(indices, host.hashes(tokens)))


def test_layer_first_zero_copy_pages_are_flat_pages(hosts, tokens_of, tmp_path: Path):
    geometry = Geometry(layout="layer_first")
    writer = open_host(hosts, fs_config(tmp_path), zero_copy=True, geometry=geometry)
    tokens = tokens_of(4, geometry.page_tokens)
    writer.backup(tokens)
    writer.close()
    hosts.remove(writer)
    reader = open_host(hosts, fs_config(tmp_path), zero_copy=False, geometry=geometry)
    _, completed, indices = reader.prefetch(tokens, scribble=True)
    assert completed == len(tokens)
    assert all(reader.matching_pages(indices, reader.hashes(tokens)))


def test_single_page_calls(hosts, backends, tokens_of):
    host = open_host(hosts, {"cpu_bytes_to_use": 4 * MIB})
    backend = direct_backend(backends, host, {"cpu_bytes_to_use": 4 * MIB})
    (page_hash,) = host.hashes(tokens_of(1, host.geometry.page_tokens))
    page = page_contents(page_hash, host.geometry)
    assert not backend.exists(page_hash)
    assert backend.get(page_hash, host.host_pool.get_dummy_flat_data_page()) is None
    assert backend.set(page_hash, page)
    assert backend.exists(page_hash)
    got = backend.get(page_hash, host.host_pool.get_dummy_flat_data_page())
    assert got is not None and torch.equal(got, page)
    assert torch.equal(backend.batch_get([page_hash])[0], page)


def test_storage_metrics_report_each_call(hosts, backends, tokens_of):
    host = open_host(hosts, {"cpu_bytes_to_use": 4 * MIB})
    backend = direct_backend(
        backends, host, {"cpu_bytes_to_use": 4 * MIB}, enable_storage_metrics=True
    )
    tokens = tokens_of(5, host.geometry.page_tokens)
    hashes = host.hashes(tokens)
    indices = host.fill(tokens)
    assert backend.batch_set_v1(hashes, indices) == [True] * 5
    assert backend.batch_exists(hashes) == 5
    assert backend.batch_get_v1(hashes, indices) == [True] * 5
    metrics = backend.get_stats()
    assert (metrics.prefetch_pgs, metrics.backup_pgs) == ([5], [5])
    assert metrics.prefetch_bandwidth[0] > 0 and metrics.backup_bandwidth[0] > 0
    again = backend.get_stats()
    assert (again.prefetch_pgs, again.backup_pgs) == ([], [])


def test_clear_drops_the_pages_of_every_tier(hosts, tokens_of, tmp_path):
    host = open_host(hosts, fs_config(tmp_path))
    tokens = tokens_of(4, host.geometry.page_tokens)
    host.backup(tokens)
    manager = host.backend.page_store.manager
    pages = len(tokens) // host.geometry.page_tokens

    def on_disk() -> Step:
        return Step.DONE if len(list(tmp_path.rglob("*.kvt"))) >= pages else Step.WAIT

    # Each file is in place before its cascade's completion wakes the wait.
    reached = step_until_blocking(manager.host, on_disk, deadline=time.monotonic() + 30)
    assert reached, "the pages never reached the fs tier"
    assert host.controller.clear_storage_backend()
    assert manager.primary.num_stored == 0
    assert not list(tmp_path.rglob("*.kvt"))
    assert host.prefetch(tokens)[:2] == (0, 0)
    host.close()
    hosts.remove(host)
    # A restart on the same root finds nothing either, and stores as before.
    restarted = open_host(hosts, fs_config(tmp_path))
    assert restarted.prefetch(tokens)[:2] == (0, 0)
    assert restarted.backup(tokens) == len(tokens)


def test_clear_says_so_when_a_tier_keeps_its_pages(hosts, tokens_of, tmp_path):
    kvtier = {
        "cpu_bytes_to_use": 4 * MIB,
        "secondary_tiers": [{"type": "LateThreadTier", "module_path": "late_tier"}],
    }
    host = open_host(hosts, kvtier)
    tokens = tokens_of(3, host.geometry.page_tokens)
    host.backup(tokens)
    # SGLang's controller answers True whatever the backend says; the backend does not.
    assert host.backend.clear() is False
    assert host.backend.page_store.manager.primary.num_stored == 0
    _, completed, indices = host.prefetch(tokens, scribble=True)
    assert completed == len(tokens)
    assert all(host.matching_pages(indices, host.hashes(tokens)))


def test_clear_with_the_primary_tier_alone_forgets_everything(hosts, tokens_of):
    host = open_host(hosts, {"cpu_bytes_to_use": 4 * MIB})
    tokens = tokens_of(4, host.geometry.page_tokens)
    host.backup(tokens)
    assert host.controller.clear_storage_backend()
    assert host.prefetch(tokens)[:2] == (0, 0)


def test_a_closed_backend_answers_misses(hosts, backends, tokens_of):
    host = open_host(hosts, {"cpu_bytes_to_use": 4 * MIB})
    backend = direct_backend(backends, host, {"cpu_bytes_to_use": 4 * MIB})
    tokens = tokens_of(2, host.geometry.page_tokens)
    hashes = host.hashes(tokens)
    indices = host.fill(tokens)
    backend.batch_set_v1(hashes, indices)
    backend.close()
    backend.close()
    assert backend.batch_exists(hashes) == 0
    assert backend.batch_get_v1(hashes, indices) == [False, False]


def test_wrong_host_indices_are_a_miss_not_a_crash(hosts, backends, tokens_of):
    host = open_host(hosts, {"cpu_bytes_to_use": 4 * MIB})
    backend = direct_backend(backends, host, {"cpu_bytes_to_use": 4 * MIB})
    tokens = tokens_of(2, host.geometry.page_tokens)
    indices = host.fill(tokens)
    assert backend.batch_set_v1(host.hashes(tokens), indices[:-1]) == [False, False]


@pytest.mark.parametrize(
    ("kvtier", "match"),
    [
        ({"cpu_bytes_to_use": 4 * MIB, "block_size": 64}, r"kvtier\.block_size"),
        ({"cpu_bytes_to_use": 4 * MIB, "eviction_polcy": "lru"}, "eviction_polcy"),
        ({}, "cpu_bytes_to_use"),
    ],
)
def test_bad_kvtier_settings_fail_the_attach(hosts, kvtier, match):
    with pytest.raises(ConfigError, match=match):
        HiCacheHost("dynamic", kvtier_extra_config(kvtier))


def test_settings_that_are_not_a_mapping_fail_the_attach():
    with pytest.raises(ConfigError, match="kvtier"):
        HiCacheHost("dynamic", {**kvtier_extra_config({}), "kvtier": ["fs"]})


def test_pools_beyond_kv_fail_the_attach(hosts, backends):
    host = open_host(hosts, {"cpu_bytes_to_use": 4 * MIB})
    backend = KVTierHiCacheStorage(storage_config({"cpu_bytes_to_use": 4 * MIB}), {})
    backends.append(backend)
    backend.register_mem_pool_host(host.host_pool)
    backend.register_mem_host_pool_v2(host.host_pool, PoolName.KV)
    backend.register_mem_host_pool_v2(host.host_pool, PoolName.MAMBA)
    with pytest.raises(UnsupportedPoolError, match="mamba"):
        backend.on_host_pools_registered()


def test_mla_ranks_share_a_namespace_and_mha_ranks_do_not(hosts, backends):
    host = open_host(hosts, {"cpu_bytes_to_use": 4 * MIB})
    kvtier = {"cpu_bytes_to_use": 4 * MIB}
    mla = [
        direct_backend(backends, host, kvtier, is_mla_model=True, tp_rank=r, tp_size=2)
        for r in range(2)
    ]
    mha = [direct_backend(backends, host, kvtier, tp_rank=r, tp_size=2) for r in range(2)]
    assert mla[0].page_store.namespace == mla[1].page_store.namespace
    assert mha[0].page_store.namespace != mha[1].page_store.namespace
    assert "@tp1of2" in mha[1].page_store.namespace
    pp = direct_backend(backends, host, kvtier, pp_rank=1, pp_size=2)
    assert "@pp1of2" in pp.page_store.namespace
