"""kvtier under SGLang's ``--hicache-host-memory-mode buffer_only``: host memory only
stages writes, SGLang frees a host page as soon as kvtier acknowledges it, and kvtier's
copy is the only one. Every page kvtier acknowledged must come back byte-exact later,
however much the primary tier evicted meanwhile."""

from __future__ import annotations

from typing import Any

import pytest
from sglang_host import Geometry, HiCacheHost, store_of
from sglang_host import open_host as open_any_host
from sglang_procs import MIB, fs_config

from kvtier.errors import ConfigError


def open_host(hosts: list[HiCacheHost], kvtier: dict[str, Any], **kwargs: Any) -> HiCacheHost:
    return open_any_host(hosts, kvtier, host_memory_mode="buffer_only", **kwargs)


def row(geometry: Geometry) -> int:
    """Bytes of one primary slot for a page of ``geometry``."""
    return -(-geometry.page_bytes // 4096) * 4096


def write_all(host: HiCacheHost, sequences: list[list[int]]) -> list[int]:
    """Each sequence written as SGLang's buffer mode writes it (host pages freed at the
    acknowledgement); the tokens acknowledged for each."""
    return [host.backup_and_free(tokens) for tokens in sequences]


def assert_acknowledged_pages_read_back(
    host: HiCacheHost, sequences: list[list[int]], acknowledged: list[int]
) -> None:
    """Every acknowledged page of every sequence comes back byte-exact."""
    for number, (tokens, acked) in enumerate(zip(sequences, acknowledged, strict=True)):
        if acked == 0:
            continue
        head = tokens[:acked]
        hit, completed, indices = host.prefetch(head, scribble=True)
        assert (hit, completed) == (acked, acked), (
            f"sequence {number}: {acked} tokens acknowledged, {hit} found, {completed} read"
        )
        assert all(host.matching_pages(indices, host.hashes(head))), f"sequence {number}"
        host.free(indices)


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "generic"])
@pytest.mark.parametrize("controller", ["hybrid", "plain"])
def test_pages_read_back_byte_exact_after_sglang_freed_its_host_pages(
    hosts, tokens_of, tmp_path, controller, zero_copy
):
    host = open_host(hosts, fs_config(tmp_path), controller=controller, zero_copy=zero_copy)
    assert host.backend.host_memory_mode == "buffer_only"
    assert store_of(host).lasting_acks
    tokens = tokens_of(20, host.geometry.page_tokens)
    assert host.backup_and_free(tokens) == len(tokens)
    # Acknowledged means on disk: the fs tier has every page before the write returned.
    fs = store_of(host).manager.tiers[0]
    assert all(fs.contains(key) for key in _keys(host, tokens))

    store_of(host).manager.reset_cache()  # the primary tier forgets: the disk answers
    assert_acknowledged_pages_read_back(host, [tokens], [len(tokens)])
    host.drain_queues()


def test_without_a_secondary_tier_the_primary_tier_holds_what_it_acknowledged(hosts, tokens_of):
    host = open_host(hosts, {"cpu_bytes_to_use": 4 * MIB})
    assert store_of(host).lasting_wait_s == 0  # acknowledged once in the primary tier
    page = host.geometry.page_tokens
    sequences = [tokens_of(6, page) for _ in range(3)]
    acknowledged = write_all(host, sequences)
    assert acknowledged == [6 * page] * 3
    assert_acknowledged_pages_read_back(host, sequences, acknowledged)


def test_eviction_under_a_stream_of_writes_loses_no_acknowledged_page(hosts, tokens_of, tmp_path):
    # Room for 8 pages in the primary tier; 64 pages are written, 8 per operation, so
    # the primary tier evicts all along while the cascades to disk run.
    geometry = Geometry()
    host = open_host(hosts, fs_config(tmp_path, cpu_bytes=8 * row(geometry)))
    sequences = [tokens_of(8, geometry.page_tokens) for _ in range(8)]
    acknowledged = write_all(host, sequences)
    assert acknowledged == [len(tokens) for tokens in sequences]
    store = store_of(host)
    assert (store.num_chunks, store.stats()["stored"]) == (8, 64)  # 56 were evicted
    assert_acknowledged_pages_read_back(host, sequences, acknowledged)


def test_a_page_whose_cascade_was_dropped_is_not_acknowledged(hosts, tokens_of, tmp_path):
    """Back-pressure drops every cascade once the fs tier has answered once: those
    pages live in the primary tier alone, which evicts them for later writes. Had they
    been acknowledged, SGLang would have freed its only other copy: a silent miss.

    Each write is 4 pages, half the primary tier: one cascade each, so the first write's
    is the fs tier's only answer before the rest."""
    geometry = Geometry()
    pressured = {"policy": "drop", "high_water": 1e-9, "low_water": 0.0, "warmup": 0}
    config = fs_config(tmp_path, cpu_bytes=8 * row(geometry), backpressure=pressured)
    host = open_host(hosts, config)
    sequences = [tokens_of(4, geometry.page_tokens) for _ in range(8)]
    acknowledged = write_all(host, sequences)

    stats = store_of(host).manager.diagnostics.tier_stats()["1:fs"]
    assert stats["stores_dropped"] > 0  # the case this test is about did happen
    assert_acknowledged_pages_read_back(host, sequences, acknowledged)
    assert acknowledged[0] == len(sequences[0])  # the first went to disk
    assert 0 in acknowledged  # and the dropped ones were not acknowledged


def test_a_failing_tier_leaves_pages_unacknowledged_and_misses_later(hosts, tokens_of):
    from scripted_tier import ScriptedTier

    tag = f"failing-{id(hosts)}"
    host = open_host(
        hosts,
        {
            "cpu_bytes_to_use": 4 * MIB,
            "secondary_tiers": [
                {"type": "ScriptedTier", "module_path": "scripted_tier", "tag": tag}
            ],
        },
    )
    tier = ScriptedTier.instances[tag]
    page = host.geometry.page_tokens
    good, bad = tokens_of(4, page), tokens_of(4, page)
    assert host.backup_and_free(good) == len(good)
    tier.fail_stores = True
    assert host.backup_and_free(bad) == 0
    assert store_of(host).stats()["store_failures"] == 4
    assert host.threads_alive()
    assert_acknowledged_pages_read_back(host, [good], [len(good)])


def test_a_store_gate_is_refused_where_kvtier_holds_the_only_copy(hosts):
    with pytest.raises(ConfigError, match=r"kvtier\.store_threshold: .*buffer_only"):
        open_host(hosts, {"cpu_bytes_to_use": 4 * MIB, "store_threshold": 2})


def _keys(host: HiCacheHost, tokens: list[int]) -> list[bytes]:
    from kvtier.integrations.sglang import page_key

    return [page_key(h) for h in host.hashes(tokens)]
