"""Every kvtier tier behind SGLang's controller: fs (restart, corrupt files), s3 on a
real server on loopback, p2p between two engines, and tiers too slow for SGLang."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from pathlib import Path
from typing import Any

import sglang_procs
from s3_servers import ACCESS_KEY, SECRET_KEY, MotoServer, free_port
from sglang_host import HiCacheHost, open_host, store_of
from sglang_procs import MIB, PREFETCH_TIMEOUTS, fs_config

from kvtier.format import chunk_path
from kvtier.integrations.sglang import page_key

P2P_SECRET = "kvtier-sglang-test-secret-0123456789"


def close_host(hosts: list[HiCacheHost], host: HiCacheHost) -> None:
    host.close()
    hosts.remove(host)


def round_trip_through_tier(host: HiCacheHost, tokens: list[int], tier: str) -> None:
    """Back ``tokens`` up, empty the primary tier, prefetch them back: byte-exact,
    and every page read from ``tier``."""
    assert host.backup(tokens) == len(tokens)
    store = store_of(host)
    store.manager.reset_cache()  # waits for the cascades, then empties the primary
    hit, completed, indices = host.prefetch(tokens, scribble=True)
    assert (hit, completed) == (len(tokens), len(tokens))
    assert all(host.matching_pages(indices, host.hashes(tokens)))
    pages = len(tokens) // host.geometry.page_tokens
    assert store.manager.diagnostics.tier_stats()[tier]["hits"] == pages


# ---------------------------------------------------------------------- fs


def test_fs_tier_round_trip(hosts, tokens_of, tmp_path):
    host = open_host(hosts, fs_config(tmp_path))
    round_trip_through_tier(host, tokens_of(12, host.geometry.page_tokens), "1:fs")


def test_a_restart_on_the_same_fs_root_finds_what_was_stored(hosts, tokens_of, tmp_path):
    first = open_host(hosts, fs_config(tmp_path))
    tokens = tokens_of(10, first.geometry.page_tokens)
    assert first.backup(tokens) == len(tokens)
    close_host(hosts, first)  # drains the cascades

    restarted = open_host(hosts, fs_config(tmp_path))
    hit, completed, indices = restarted.prefetch(tokens, scribble=True)
    assert (hit, completed) == (len(tokens), len(tokens))
    assert all(restarted.matching_pages(indices, restarted.hashes(tokens)))


def test_another_model_on_the_same_fs_root_finds_nothing(hosts, tokens_of, tmp_path):
    writer = open_host(hosts, fs_config(tmp_path), model_name="model-a")
    tokens = tokens_of(4, writer.geometry.page_tokens)
    writer.backup(tokens)
    close_host(hosts, writer)
    other = open_host(hosts, fs_config(tmp_path), model_name="model-b")
    assert other.prefetch(tokens)[:2] == (0, 0)
    assert len(list(tmp_path.glob("*/namespace.json"))) == 2


def chunk_file(root: Path, page_hash: str) -> Path:
    (path,) = root.glob(f"*/{chunk_path(page_key(page_hash))}")
    return path


def test_a_corrupt_chunk_ends_the_hit_run_at_its_page(hosts, tokens_of, tmp_path):
    writer = open_host(hosts, fs_config(tmp_path))
    page = writer.geometry.page_tokens
    tokens = tokens_of(8, page)
    hashes = writer.hashes(tokens)
    writer.backup(tokens)
    close_host(hosts, writer)
    damaged = chunk_file(tmp_path, hashes[5])
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0x01  # a payload byte: the header still parses
    damaged.write_bytes(bytes(data))

    reader = open_host(hosts, fs_config(tmp_path))
    hit, completed, indices = reader.prefetch(tokens, scribble=True)
    assert hit == len(tokens)  # the file is there; its bytes are checked on load
    assert completed == 5 * page
    matching = reader.matching_pages(indices, hashes)
    assert matching[:5] == [True] * 5
    # Not one byte of the damaged chunk reached the host pool.
    assert reader.untouched_pages(indices, 8)[5]
    stats = store_of(reader).manager.diagnostics.tier_stats()["1:fs"]
    assert stats["integrity_failures"] == 1
    assert not damaged.exists()  # discarded, never served again

    hit, completed, _ = reader.prefetch(tokens)
    assert (hit, completed) == (5 * page, 5 * page)


def test_a_truncated_chunk_is_a_miss(hosts, tokens_of, tmp_path):
    writer = open_host(hosts, fs_config(tmp_path))
    page = writer.geometry.page_tokens
    tokens = tokens_of(4, page)
    hashes = writer.hashes(tokens)
    writer.backup(tokens)
    close_host(hosts, writer)
    damaged = chunk_file(tmp_path, hashes[0])
    damaged.write_bytes(damaged.read_bytes()[:-1000])

    reader = open_host(hosts, fs_config(tmp_path))
    _, completed, indices = reader.prefetch(tokens, scribble=True)
    assert completed == 0
    assert reader.untouched_pages(indices, 1) == [True]


# ---------------------------------------------------------------------- s3


def s3_config(moto: MotoServer, bucket: str) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": 4 * MIB,
        "secondary_tiers": [
            {
                "type": "s3",
                "bucket": bucket,
                "endpoint_url": moto.endpoint,
                "access_key_id": ACCESS_KEY,
                "secret_access_key": SECRET_KEY,
            }
        ],
    }


def test_s3_tier_round_trip(hosts, tokens_of, moto, bucket):
    host = open_host(hosts, s3_config(moto, bucket))
    round_trip_through_tier(host, tokens_of(6, host.geometry.page_tokens), "1:s3")


def test_a_restart_reads_what_another_engine_put_in_the_bucket(hosts, tokens_of, moto, bucket):
    writer = open_host(hosts, s3_config(moto, bucket))
    tokens = tokens_of(5, writer.geometry.page_tokens)
    writer.backup(tokens)
    close_host(hosts, writer)
    reader = open_host(hosts, s3_config(moto, bucket))
    hit, completed, indices = reader.prefetch(tokens, scribble=True)
    assert (hit, completed) == (len(tokens), len(tokens))
    assert all(reader.matching_pages(indices, reader.hashes(tokens)))


# --------------------------------------------------------------------- p2p


def p2p_config(**tier: Any) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": 4 * MIB,
        "secondary_tiers": [
            {
                "type": "p2p",
                "secret": P2P_SECRET,
                "reconnect_initial_s": 0.05,
                "reconnect_max_s": 0.5,
                **tier,
            }
        ],
    }


def test_p2p_tier_reads_another_engines_primary_tier(hosts, tokens_of):
    owner = open_host(hosts, p2p_config(listen="127.0.0.1:0"))
    address = store_of(owner).manager.tiers[0].listen_address
    reader = open_host(hosts, p2p_config(listen="127.0.0.1:0", peers=[address]))
    tokens = tokens_of(6, owner.geometry.page_tokens)
    assert owner.backup(tokens) == len(tokens)

    # The owner announces what it stored; the reader's lookups are index probes.
    deadline = time.monotonic() + 30
    p2p = store_of(reader).manager.tiers[0]
    keys = [page_key(h) for h in reader.hashes(tokens)]
    while not all(p2p.contains(key) for key in keys):
        assert time.monotonic() < deadline, "the owner's keys never reached the reader"
        time.sleep(0.02)
    hit, completed, indices = reader.prefetch(tokens, scribble=True)
    assert (hit, completed) == (len(tokens), len(tokens))
    assert all(reader.matching_pages(indices, reader.hashes(tokens)))
    assert store_of(reader).manager.diagnostics.tier_stats()["1:p2p"]["hits"] == 6


# ------------------------------------------------------- slow tiers, failures


def slow_config(delay_s: float, tag: str) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": 4 * MIB,
        "secondary_tiers": [
            {
                "type": "ScriptedTier",
                "module_path": "scripted_tier",
                "tag": tag,
                "instant": True,
                "load_delay_s": delay_s,
            }
        ],
    }


def test_a_tier_slower_than_sglang_allows_ends_as_fewer_pages_not_a_stuck_thread(hosts, tokens_of):
    delay = 4 * PREFETCH_TIMEOUTS["prefetch_timeout_base"]
    host = open_host(hosts, slow_config(delay, f"slow-{uuid.uuid4().hex[:8]}"))
    tokens = tokens_of(4, host.geometry.page_tokens)
    host.backup(tokens)
    store_of(host).manager.reset_cache()

    started = time.monotonic()
    hit, completed, indices = host.prefetch(tokens, scribble=True)
    took = time.monotonic() - started
    assert hit == len(tokens)  # the tier holds them...
    assert completed == 0  # ...but cannot deliver them within SGLang's time-out
    assert took < delay, f"the prefetch waited {took:.1f} s for a {delay} s tier"
    # It waited as long as SGLang's settings give a prefetch, not kvtier's own guess.
    assert took >= PREFETCH_TIMEOUTS["prefetch_timeout_base"]
    assert host.untouched_pages(indices, 4) == [True] * 4
    assert host.threads_alive()

    # The promotion finishes later: the next prefetch gets the pages from the primary.
    deadline = time.monotonic() + 2 * delay
    while store_of(host).manager.has_pending_work():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    hit, completed, indices = host.prefetch(tokens, scribble=True)
    assert completed == len(tokens)
    assert all(host.matching_pages(indices, host.hashes(tokens)))


def test_sglangs_failure_injector_never_lets_a_wrong_byte_through(
    hosts, tokens_of, tmp_path, monkeypatch
):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    host = open_host(hosts, fs_config(tmp_path))
    assert type(host.backend).__name__ == "HiCacheStorageFailureInjector"
    page = host.geometry.page_tokens
    sequences = [tokens_of(6, page) for _ in range(12)]
    stored = [host.backup(tokens) for tokens in sequences]
    for tokens, backed_up in zip(sequences, stored, strict=True):
        hit, completed, indices = host.prefetch(tokens, scribble=True)
        assert completed <= min(hit, backed_up)
        if indices is not None:
            done = completed // page
            matching = host.matching_pages(indices, host.hashes(tokens)[: hit // page])
            untouched = host.untouched_pages(indices, hit // page)
            assert all(matching[:done])
            # Past the pages SGLang counts: each left alone, or holding its own bytes.
            assert all(m or u for m, u in zip(matching, untouched, strict=True))
            host.free(indices)
    assert host.threads_alive()
    # Whatever SGLang was told is stored, kvtier has (asked past the injector).
    backend = host.backend._backend
    for tokens, backed_up in zip(sequences, stored, strict=True):
        assert backend.batch_exists(host.hashes(tokens)) == backed_up // page


# ---------------------------------------------------------------- two TP ranks

SPAWN = multiprocessing.get_context("spawn")


def test_two_tp_ranks_in_two_processes_keep_their_own_bytes_and_agree(tokens_of, tmp_path):
    """Two tensor-parallel ranks, each a process with its own kvtier backend, share one
    fs root: each reads back its own share of every page (the namespaces keep them
    apart), and SGLang's rank consensus sees one rank's corrupt chunk on both."""
    tokens = tokens_of(8, 8)
    port = free_port()
    ranks = []
    for rank in range(2):
        conn, child = SPAWN.Pipe()
        proc = SPAWN.Process(
            target=sglang_procs.tp_rank, args=(rank, 2, port, str(tmp_path), tokens, child)
        )
        proc.start()
        child.close()
        ranks.append((proc, conn))
    try:
        stored = [receive(conn) for _, conn in ranks]
        assert [s[:2] for s in stored] == [("stored", len(tokens))] * 2
        assert "tp0of2" in stored[0][2] and "tp1of2" in stored[1][2]
        assert sorted(p.name.split("_")[-2] for p in tmp_path.glob("*/")) == ["tp0of2", "tp1of2"]

        # Rank 1's chunk of page 5 goes bad: rank 1 can serve 5 pages, rank 0 all 8.
        (rank1_dir,) = tmp_path.glob("*tp1of2_*")
        page_hash = hashes_of(tokens)[5]
        damaged = rank1_dir / chunk_path(page_key(page_hash))
        data = bytearray(damaged.read_bytes())
        data[-1] ^= 0xFF
        damaged.write_bytes(bytes(data))

        for _, conn in ranks:
            conn.send("read")
        results = [receive(conn) for _, conn in ranks]
        for conn_result in results:
            _, hit, completed, exact = conn_result
            assert hit == len(tokens)
            assert completed == 5 * 8  # both ranks take the pages every rank has
            assert exact[:5] == [True] * 5
        for _, conn in ranks:
            conn.send("exit")
    finally:
        for proc, conn in ranks:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
            conn.close()
    assert [proc.exitcode for proc, _ in ranks] == [0, 0]


def receive(conn: Any) -> Any:
    assert conn.poll(120), "a rank did not answer"
    return conn.recv()


def hashes_of(tokens: list[int]) -> list[str]:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return list(get_storage_hash_str(tokens, None, page_size=8))
