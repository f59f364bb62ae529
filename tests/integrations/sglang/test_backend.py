"""kvtier behind SGLang's real controllers: pages stored by the backup thread come back
byte-exact through the prefetch threads, on both of SGLang's storage interfaces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sglang_host import Geometry, open_host, store_of
from sglang_procs import MIB, fs_config


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "generic"])
@pytest.mark.parametrize("controller", ["hybrid", "plain"])
def test_pages_round_trip_byte_exact(hosts, tokens_of, zero_copy, controller):
    host = open_host(
        hosts, {"cpu_bytes_to_use": 4 * MIB}, zero_copy=zero_copy, controller=controller
    )
    page = host.geometry.page_tokens
    tokens = tokens_of(20, page)
    assert host.backup(tokens) == len(tokens)
    hit, completed, indices = host.prefetch(tokens, scribble=True)
    assert (hit, completed) == (len(tokens), len(tokens))
    assert all(host.matching_pages(indices, host.hashes(tokens)))
    assert store_of(host).stats()["loaded"] == 20
    host.drain_queues()


def test_each_page_is_one_chunk_named_by_its_sglang_hash(hosts, tokens_of):
    host = open_host(hosts, {"cpu_bytes_to_use": 4 * MIB})
    tokens = tokens_of(5, host.geometry.page_tokens)
    host.backup(tokens)
    manager = store_of(host).manager
    stored = set(manager.primary.slots())
    wanted = {bytes.fromhex(h) + bytes(4) for h in host.hashes(tokens)}
    assert stored == wanted
    assert store_of(host).page_bytes == host.geometry.page_bytes


def test_a_shared_prefix_hits_up_to_where_the_prompts_diverge(hosts, tokens_of):
    host = open_host(hosts, {"cpu_bytes_to_use": 4 * MIB})
    page = host.geometry.page_tokens
    shared = tokens_of(6, page)
    first = shared + tokens_of(4, page)
    host.backup(first)

    divergent = shared + tokens_of(5, page)
    hit, completed, indices = host.prefetch(divergent, scribble=True)
    assert (hit, completed) == (6 * page, 6 * page)
    assert all(host.matching_pages(indices, host.hashes(divergent)[:6]))

    # The same tokens after another first page are other chains: nothing hits.
    shifted = tokens_of(1, page) + first[page:]
    assert host.prefetch(shifted)[:2] == (0, 0)

    head = first[: 3 * page]
    hit, completed, indices = host.prefetch(head)
    assert (hit, completed) == (3 * page, 3 * page)
    assert all(host.matching_pages(indices, host.hashes(head)))


def test_stored_pages_are_not_written_again(hosts, tokens_of):
    host = open_host(hosts, {"cpu_bytes_to_use": 4 * MIB})
    tokens = tokens_of(4, host.geometry.page_tokens)
    host.backup(tokens)
    assert host.backup(tokens) == len(tokens)
    stats = store_of(host).stats()
    assert (stats["stored"], stats["already_stored"]) == (4, 4)


def test_pages_beyond_the_primary_tier_come_back_from_the_fs_tier(hosts, tokens_of, tmp_path):
    # Room for 8 pages: storing 24 evicts most of them from the primary tier.
    geometry = Geometry()
    host = open_host(hosts, fs_config(tmp_path, cpu_bytes=8 * _row(geometry)))
    page = geometry.page_tokens
    tokens = tokens_of(24, page)
    assert host.backup(tokens) == len(tokens)
    store_of(host).manager.reset_cache()  # cascades done: every page is on disk
    hit, completed, indices = host.prefetch(tokens[: 6 * page], scribble=True)
    assert (hit, completed) == (6 * page, 6 * page)
    assert all(host.matching_pages(indices, host.hashes(tokens[: 6 * page])))
    read = store_of(host).manager.diagnostics.tier_stats()["1:fs"]
    assert read["bytes_read"] == 6 * _row(geometry)


def _row(geometry: Geometry) -> int:
    """Bytes of one primary slot for a page of ``geometry``."""
    return -(-geometry.page_bytes // 4096) * 4096


def test_the_zero_copy_page_is_the_flat_page(hosts, tokens_of, tmp_path: Path):
    """Both interfaces store a page as SGLang's flat page: what one wrote, the other
    reads, on a restart over the same fs tier."""
    writer = open_host(hosts, fs_config(tmp_path), zero_copy=True)
    tokens = tokens_of(6, writer.geometry.page_tokens)
    writer.backup(tokens)
    writer.close()
    hosts.remove(writer)
    reader = open_host(hosts, fs_config(tmp_path), zero_copy=False)
    hit, completed, indices = reader.prefetch(tokens, scribble=True)
    assert (hit, completed) == (len(tokens), len(tokens))
    assert all(reader.matching_pages(indices, reader.hashes(tokens)))


def test_geometry_mismatch_is_refused_by_the_page_store(hosts):
    host = open_host(hosts, {"cpu_bytes_to_use": 4 * MIB})
    store = store_of(host)
    page = torch.zeros(store.page_bytes // 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bytes in its segments"):
        store.store([b"k" * 36], [[(page.data_ptr(), page.numel())]], 1.0)
