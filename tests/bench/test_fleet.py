"""The fleet benchmark (benchmarks/fleet.py): its workload, its cross-engine count, and
a quick sweep of real engine processes sharing through p2p, fs and memcached."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest
from fleet import QUICK, CrossEngine, FleetRequest, build_requests, parse_args, run_sweep
from fleet_engine import tcp_sockets
from fleet_servers import listener_pids, process_cpu_s, process_rss_bytes

from kvtier.bench.workloads import chain_keys

SHM_DIR = Path("/dev/shm")


def test_users_ask_the_same_prompts_whatever_the_fleet_size():
    two, eight = build_requests(QUICK, 2), build_requests(QUICK, 8)
    assert [r.blocks for r in two] == [r.blocks for r in eight]
    assert {r.engine for r in two} == {0, 1}
    assert {r.engine for r in eight} <= set(range(8)) and len({r.engine for r in eight}) > 2
    assert build_requests(QUICK, 8) == eight  # seeded


def test_requests_share_their_system_prompt_and_nothing_else():
    requests = build_requests(QUICK, 2)
    shared = QUICK.prompt_chunks
    by_prompt: dict[tuple[int, ...], list[FleetRequest]] = {}
    for request in requests:
        by_prompt.setdefault(request.blocks[:shared], []).append(request)
    assert len(by_prompt) == QUICK.prompts
    suffixes = [r.blocks[shared:] for r in requests]
    assert len(set(suffixes)) == len(requests)


def test_a_chunk_another_engine_held_in_an_earlier_wave_is_eligible_once():
    first = FleetRequest("a", 0, (1, 2))
    cross = CrossEngine({})
    cross.count([first], {"a": 0})
    assert (cross.eligible, cross.hits) == (0, 0)  # nobody held them before
    # Engine 1 asks for them twice in one wave and finds one of the two chunks.
    again = [FleetRequest("b", 1, (1, 2)), FleetRequest("c", 1, (1, 2))]
    cross.count(again, {"b": 1, "c": 2})
    assert (cross.eligible, cross.hits) == (2, 1)
    # Engine 0 held them itself: never eligible for it.
    cross.count([FleetRequest("d", 0, (1, 2))], {"d": 0})
    assert cross.eligible == 2
    assert cross.held[chain_keys((1, 2))[1]] == {0, 1}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engines", "2,x"], "--engines: expected comma-separated integers"),
        (["--engines", "1"], "--engines: a fleet has at least 2 engines"),
        (["--tiers", "p2p,nfs"], "--tiers: unknown sharing tier 'nfs'"),
        (["--primary-mib", "0"], "--primary-mib: expected at least 1"),
    ],
)
def test_bad_arguments_are_refused_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_tcp_sockets_counts_this_process_s_connections_and_listeners():
    established, listening = tcp_sockets()
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = server.accept()
            with accepted:
                # Both ends of a loopback connection are this process's.
                assert tcp_sockets() == (established + 2, listening + 1)
                assert listener_pids(port) == [os.getpid()]
    assert tcp_sockets() == (established, listening)


def test_process_figures_read_proc():
    assert process_cpu_s(os.getpid()) > 0
    assert process_rss_bytes("self") > 1 << 20
    assert process_cpu_s(1 << 30) == 0.0 and process_rss_bytes(1 << 30) == 0  # no such pid


@pytest.mark.slow
def test_a_quick_fleet_of_two_finds_chunks_the_other_engine_stored(tmp_path):
    tiers = ["p2p", "fs"] + (["memcached"] if shutil.which("memcached") else [])
    before = set(SHM_DIR.glob("kvtier_fleet*"))
    lines: list[str] = []
    baseline, *results = run_sweep(QUICK, [2], tiers, tmp_path, progress=lines.append)
    # Without a sharing tier the same requests find nothing another engine stored.
    assert baseline["tier"] == "none" and baseline["cross_engine_eligible"] > 0
    assert baseline["cross_engine_hits"] == 0 and baseline["tier_bytes_read"] == 0
    assert [r["tier"] for r in results] == tiers
    for result in results:
        assert "error" not in result and "skipped" not in result, result
        name = result["tier"]
        assert result["requests"] == QUICK.requests
        assert result["cross_engine_eligible"] > 0, name
        assert result["cross_engine_hits"] > 0, name
        assert 0 < result["cross_engine_hit_rate"] <= 1
        assert result["wrong_chunks"] == 0
        assert result["integrity_failures"] == result["promotion_failures"] == 0
        assert result["tier_bytes_read"] > 0 and result["gbps"] > 0
        assert 0 <= result["wait_p50_ms"] <= result["wait_p99_ms"] < 1e4
        assert result["cpu_s_per_gib"] > 0 and result["sharing_cpu_s_per_gib"] is not None
        assert len(result["per_engine"]) == 2
    p2p, fs = results[0], results[1]
    for engine in p2p["per_engine"]:
        # A full mesh of two: one connection each way, seen by the tier and in /proc.
        assert engine["p2p_outbound"] == engine["p2p_inbound"] == 1
        assert engine["tcp_connections"] == 2
        assert engine["indexed_keys"] > 0 and engine["index_bytes"] > 0
        assert engine["announce_bytes_sent"] > 0 and engine["announce_bytes_received"] > 0
    assert p2p["tier_bytes_written"] == 0  # p2p stores nothing: it announces
    assert fs["tier_bytes_written"] > 0
    assert all(engine["tcp_connections"] == 0 for engine in fs["per_engine"])
    assert set(SHM_DIR.glob("kvtier_fleet*")) == before  # every engine closed its region
