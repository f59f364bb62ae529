"""p2p tier promotion throughput against raw loopback TCP of the same bytes, same run.

Two processes on loopback:

- the *owner* (a spawned child) fills its primary tier with ``--total-gib`` of
  incompressible chunks and stores them, which announces them to its readers;
- the *reader* (this process) waits until its peer index holds every key, then, each
  round, promotes them all through its tiering manager (requests of ``--job-chunks``
  chunks, each one promotion job, ``--in-flight`` at once), empties its primary tier,
  and measures raw TCP between the same two processes: the owner ``socket.sendall``s
  the same number of rows of its region, the reader ``socket.recv_into``s them into
  the rows of its own region (the memory promotions write), with the same chunk size.

The rounds interleave promotion and raw passes and the report takes the median of
each round's ratio: the machine is shared and loopback speed drifts. An event-loop
probe on the reader measures how late its 1 ms timers fire while promotions run, and,
for comparison, while the raw transfer runs on a thread and the loop has nothing to do
(what is left is the operating system's scheduling on a busy machine).

The last line is one JSON object with the figures; docs/benchmarks/p2p-tier.md records them.

    python benchmarks/p2p_tier.py [--total-gib 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

from common import LagProbe, fill_rows, percentile, promote

from kvtier import (
    OffloadingConfig,
    OffloadingSpecFactory,
    ReqContext,
    TieringOffloadingManager,
    make_offload_key,
)
from kvtier.bench.physical import recv_exactly
from kvtier.tiers.p2p import PeerTier

MIB = 1 << 20
SECRET = "benchmark-secret-" + "0" * 16
TIMEOUT_S = 120.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-gib", type=float, default=1.0, help="GiB promoted per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument("--job-chunks", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=4, help="promotion jobs at once")
    return parser.parse_args()


def bench_keys(count: int) -> list[Any]:
    return [make_offload_key(f"p2p-bench:{i}".encode()) for i in range(count)]


async def open_manager(
    role: str, chunk: int, slots: int, tier: dict[str, Any]
) -> TieringOffloadingManager:
    config = OffloadingConfig(
        engine_id=f"bench-p2p-{role}-{uuid.uuid4().hex[:8]}",
        kv_bytes_per_block=chunk,
        model_name="bench",
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": slots * chunk,
            "secondary_tiers": [{"type": "p2p", "secret": SECRET, **tier}],
        },
    )
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    await manager.start()
    return manager


def peer_tier(manager: TieringOffloadingManager) -> PeerTier:
    tier = manager.tiers[0]
    assert isinstance(tier, PeerTier)
    return tier


# ------------------------------------------------------------------ the owner


def owner(chunk: int, count: int, conn: Connection) -> None:
    asyncio.run(_owner(chunk, count, conn))


async def _owner(chunk: int, count: int, conn: Connection) -> None:
    manager = await open_manager("owner", chunk, count + 8, {})
    assert manager.region is not None
    rows = manager.region.primary_view
    fill_rows(manager)
    keys = bench_keys(count)
    for first in range(0, count, 64):
        batch, req = keys[first : first + 64], ReqContext(f"store{first}")
        out = manager.prepare_store(batch, req)
        assert out is not None and len(out.keys_to_store) == len(batch)
        manager.complete_store(out.keys_to_store, req)
        manager.on_request_finished(req)
    await manager.drain()
    raw = socket.create_server(("127.0.0.1", 0))
    conn.send(("ready", peer_tier(manager).listen_address, raw.getsockname()[1]))
    try:
        while await asyncio.to_thread(conn.poll, TIMEOUT_S):
            if conn.recv() != "raw":
                break
            await asyncio.to_thread(send_raw, raw, rows, count)
    finally:
        raw.close()
        await manager.aclose()


def send_raw(listener: socket.socket, rows: Any, count: int) -> None:
    sock, _ = listener.accept()
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(count):
            sock.sendall(rows[i % len(rows)])
        sock.recv(1)  # the reader has everything


# ----------------------------------------------------------------- the reader


def recv_raw(port: int, rows: Any, count: int) -> float:
    """Seconds to receive ``count`` chunks into the rows of the reader's region."""
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(count):
            recv_exactly(sock, rows[i % len(rows)])
        elapsed = time.perf_counter() - started
        sock.sendall(b"k")
    return elapsed


async def run(args: argparse.Namespace) -> dict[str, float]:
    chunk = int(args.chunk_mib * MIB)
    count = int(args.total_gib * (1 << 30)) // chunk
    spawn = multiprocessing.get_context("spawn")
    conn, child = spawn.Pipe()
    proc = spawn.Process(target=owner, args=(chunk, count, child), daemon=True)
    proc.start()
    child.close()
    assert await asyncio.to_thread(conn.poll, TIMEOUT_S), "the owner did not start"
    _, address, raw_port = conn.recv()
    manager = await open_manager("reader", chunk, count + args.job_chunks, {"peers": [address]})
    try:
        tier = peer_tier(manager)
        deadline = time.monotonic() + TIMEOUT_S
        while tier.indexed_keys < count:
            assert time.monotonic() < deadline, "the owner's keys never arrived"
            await asyncio.sleep(0.01)
        assert manager.region is not None
        rows = manager.region.primary_view
        keys = bench_keys(count)
        probe, idle_probe = LagProbe(), LagProbe()
        rounds: list[dict[str, float]] = []
        latencies: list[float] = []
        for index in range(args.rounds):
            probe.start()
            read_s, job_latencies = await promote(
                manager, keys, args.job_chunks, args.in_flight, tag=f"r{index}-", strict=True
            )
            await probe.stop()
            latencies += job_latencies
            await manager.areset_cache()
            conn.send("raw")
            idle_probe.start()
            raw_s = await asyncio.to_thread(recv_raw, raw_port, rows, count)
            await idle_probe.stop()
            measured = {
                "read_gbps": count * chunk / read_s / 1e9,
                "raw_gbps": count * chunk / raw_s / 1e9,
            }
            measured["read_ratio"] = measured["read_gbps"] / measured["raw_gbps"]
            rounds.append(measured)
        manager.on_schedule_end()
        stats = manager.diagnostics.tier_stats()[manager.diagnostics.tier_labels[0]]
    finally:
        conn.send("exit")
        await manager.aclose()
        await asyncio.to_thread(proc.join, TIMEOUT_S)
    figures = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    figures.update(
        {
            "rounds": float(args.rounds),
            "chunks_per_round": float(count),
            "chunk_bytes": float(chunk),
            "job_chunks": float(args.job_chunks),
            "in_flight": float(args.in_flight),
            "read_ratio_min": min(r["read_ratio"] for r in rounds),
            "read_ratio_max": max(r["read_ratio"] for r in rounds),
            "promotion_p50_ms": percentile(latencies, 0.5) * 1e3,
            "promotion_p99_ms": percentile(latencies, 0.99) * 1e3,
            "loop_lag_p50_ms": percentile(probe.lags, 0.5) * 1e3,
            "loop_lag_p99_ms": percentile(probe.lags, 0.99) * 1e3,
            "loop_lag_raw_phase_p99_ms": percentile(idle_probe.lags, 0.99) * 1e3,
            "integrity_failures": stats["integrity_failures"],
            "promotion_failures": stats["promotion_failures"],
        }
    )
    return figures


def report(args: argparse.Namespace, figures: dict[str, float]) -> None:
    total = figures["chunks_per_round"] * figures["chunk_bytes"] / (1 << 30)
    print(
        f"p2p tier: {args.rounds} rounds of {total:.2f} GiB over loopback, "
        f"{figures['chunk_bytes'] / MIB:g} MiB chunks, jobs of {args.job_chunks} chunks, "
        f"{args.in_flight} in flight (medians of rounds)"
    )
    print(
        f"  promotion {figures['read_gbps']:6.2f} GB/s   raw TCP {figures['raw_gbps']:6.2f} GB/s"
        f"   ratio {figures['read_ratio']:.2f} "
        f"(rounds {figures['read_ratio_min']:.2f}-{figures['read_ratio_max']:.2f})"
    )
    print(
        f"  promotion latency p50 {figures['promotion_p50_ms']:.1f} ms, "
        f"p99 {figures['promotion_p99_ms']:.1f} ms"
    )
    print(
        f"  reader loop lag p50 {figures['loop_lag_p50_ms']:.2f} ms, "
        f"p99 {figures['loop_lag_p99_ms']:.2f} ms (p99 {figures['loop_lag_raw_phase_p99_ms']:.2f}"
        " ms while the raw transfer runs on a thread: the machine's own noise)"
    )
    print(
        f"  integrity failures {figures['integrity_failures']:g}, "
        f"failed promotion jobs {figures['promotion_failures']:g}"
    )
    print(json.dumps({name: round(value, 4) for name, value in figures.items()}))


def main() -> None:
    args = parse_args()
    figures = asyncio.run(run(args))
    report(args, figures)


if __name__ == "__main__":
    main()
