"""Services a bench run starts for its tiers: a p2p peer engine.

``peer_engine`` spawns a second engine: a process with its own primary tier and a p2p
tier listening on loopback, which first "computes" and stores the workload's most
recent chunks, as a neighbour that served the same users earlier would hold them. The
engine under test then reads from it what it lacks. (The s3 tier's local server is
the s3 tier's own: :mod:`kvtier.tiers.s3.bench`.)

A ``secondary_tiers`` list in ``--config`` replaces all this: the tiers are then
benchmarked as configured, against real endpoints and peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from kvtier.bench.settings import BenchSettings, bench_config
from kvtier.bench.workloads import WorkloadSize, build_workload, chain_keys
from kvtier.keys import OffloadKey
from kvtier.tiers.p2p import PeerTier

__all__ = ["PeerEngine", "peer_engine", "serve_peer"]

# Starting a Python process that imports torch, then storing up to the whole primary
# tier through it: seconds on a quiet machine, much more on a loaded one.
PEER_START_TIMEOUT_S = 300.0
PEER_STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class PeerEngine:
    """A peer engine in another process, serving its primary tier over p2p."""

    #: ``host:port`` its p2p tier listens on.
    address: str
    #: The shared secret its connections authenticate with.
    secret: str = field(repr=False)
    #: Chunks it holds (the engine under test waits until it has heard of them).
    chunks: int = 0


@contextlib.asynccontextmanager
async def peer_engine(settings: BenchSettings) -> AsyncIterator[PeerEngine]:
    """A peer engine holding ``settings.workload``'s latest chunks, while the context lasts.

    Raises:
        ValueError: the peer failed, or did not get ready in time.
    """
    secret = secrets.token_hex(24)
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    process = spawn.Process(
        target=serve_peer, args=(settings, secret, theirs), name="kvtier-bench-peer", daemon=True
    )
    process.start()
    theirs.close()
    try:
        if not await asyncio.to_thread(ours.poll, PEER_START_TIMEOUT_S):
            raise ValueError(f"the p2p peer did not get ready in {PEER_START_TIMEOUT_S:.0f} s")
        try:
            message = ours.recv()
        except EOFError:
            raise ValueError(
                f"the p2p peer exited while starting (exit code {process.exitcode})"
            ) from None
        if message[0] != "ready":
            raise ValueError(f"the p2p peer failed: {message[1]}")
        _, address, chunks = message
        yield PeerEngine(address, secret, chunks)
    finally:
        with contextlib.suppress(OSError):
            ours.send("stop")
        await asyncio.to_thread(process.join, PEER_STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            await asyncio.to_thread(process.join, PEER_STOP_TIMEOUT_S)
        ours.close()


def serve_peer(settings: BenchSettings, secret: str, conn: Connection) -> None:
    """The peer process: store the workload's latest chunks, serve them until told to stop."""
    try:
        asyncio.run(_serve_peer(settings, secret, conn))
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None


async def _serve_peer(settings: BenchSettings, secret: str, conn: Connection) -> None:
    # Imported in the peer's process, which holds tensors: the bench's own tier list
    # (and with it the ``kvtier`` command's help) imports no torch.
    from kvtier.bench.engine import Engine, copy_engine, kv_caches
    from kvtier.facade import KVTier

    workload = build_workload(
        settings.workload,
        WorkloadSize(settings.working_set_chunks, settings.max_prompt_chunks, settings.seed),
    )
    # Every distinct chunk once, in the order the workload first asks for it.
    ordered: dict[OffloadKey, None] = {}
    for wave in workload.waves:
        for request in wave.requests:
            ordered.update(dict.fromkeys(chain_keys(request.blocks)))
    tier = {"type": "p2p", "listen": "127.0.0.1:0", "secret": secret}
    config = bench_config(settings, [tier], role="peer")
    batch = settings.max_prompt_chunks
    caches = kv_caches(settings, batch)
    async with KVTier(config, caches, engine=copy_engine()) as kv:
        keys = list(ordered)[-kv.manager.host.num_chunks :]
        engine = Engine(kv, caches, batch, settings.lookup_timeout_s)
        stored = 0
        try:
            for first in range(0, len(keys), batch):
                part = keys[first : first + batch]
                stored += await engine.compute_and_store(part, f"peer-{first}")
        finally:
            await engine.aclose()
        await kv.drain()
        peer = next(t for t in kv.manager.tiers if isinstance(t, PeerTier))
        conn.send(("ready", peer.listen_address, stored))
        # Serve until the bench says stop (or goes away).
        with contextlib.suppress(EOFError, OSError):
            await asyncio.to_thread(conn.recv)
