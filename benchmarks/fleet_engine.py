"""One engine of the fleet benchmark, in its own process (spawned by ``fleet.py``).

The process imports torch once and then serves run after run: for each, it opens a
``KVTier`` with its own small primary tier and the run's one sharing tier, serves the
requests the coordinator sends it wave by wave (``kvtier.bench.engine.Engine``: look
up, load and check the hits, compute and store the rest), and reports what it measured
of itself: CPU time, TCP connections, the sharing tier's counts and its own metrics.

Commands arrive on a pipe as tuples; each gets one answer, ``("ok", value)`` or
``("error", message)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from fleet_servers import process_rss_bytes

from kvtier import KVTier, OffloadingConfig
from kvtier.bench.engine import Engine, copy_engine, kv_caches
from kvtier.bench.settings import TOKENS_PER_BLOCK, BenchSettings
from kvtier.bench.workloads import BenchRequest
from kvtier.specs.factory import with_spec_name
from kvtier.tiers.p2p import PeerTier

__all__ = ["ENGINE_ENVIRONMENT", "EngineRun", "engine_main", "tcp_sockets"]

#: Set for the engine processes (only where the environment does not say otherwise).
#: Mooncake's transfer engine listens on the first active interface unless told
#: otherwise, and the engines would send each other chunks there: loopback only.
ENGINE_ENVIRONMENT = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}

# The coordinator hears nothing for this long: it has gone, and so does the engine.
IDLE_TIMEOUT_S = 900.0
# TCP states in /proc/net/tcp.
_ESTABLISHED, _LISTEN = "01", "0A"


@dataclass(frozen=True)
class EngineRun:
    """What an engine needs to open its ``KVTier`` for one run."""

    #: The run's model name: a namespace of its own, so no run reads an earlier one's.
    model: str
    #: The sharing tier's mapping; None: no secondary tier (the CPU baseline).
    tier: dict[str, Any] | None
    chunk_bytes: int
    primary_bytes: int
    #: Requests at once, each of at most ``max_prompt_chunks`` chunks (its GPU blocks).
    in_flight: int
    max_prompt_chunks: int
    lookup_timeout_s: float


def engine_main(index: int, conn: Connection) -> None:
    """The process body: obey ``conn`` until told to exit or the coordinator goes."""
    conn.send(("ok", "started"))
    with contextlib.suppress(EOFError, KeyboardInterrupt):
        asyncio.run(_EngineProcess(index, conn).serve())


def tcp_sockets(pid: int | str = "self") -> tuple[int, int]:
    """Established and listening TCP sockets that process ``pid`` holds open."""
    inodes: set[str] = set()
    fds = Path(f"/proc/{pid}/fd")
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            target = str(fd.readlink())
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    established = listening = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    established += fields[3] == _ESTABLISHED
                    listening += fields[3] == _LISTEN
    return established, listening


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _EngineProcess:
    def __init__(self, index: int, conn: Connection) -> None:
        self.index = index
        self.conn = conn
        self.kv: KVTier | None = None
        self.engine: Engine | None = None
        self.run: EngineRun | None = None
        self.cpu_at_begin = 0.0

    async def serve(self) -> None:
        while True:
            command = await self._receive()
            if command is None or command[0] == "exit":
                await self._close()
                return
            try:
                answer: tuple[str, Any] = ("ok", await self._obey(*command))
            except Exception as exc:
                answer = ("error", f"engine {self.index}: {type(exc).__name__}: {exc}")
            self.conn.send(answer)

    async def _receive(self) -> Any:
        """The next command, without blocking the loop; None once the pipe is silent."""
        if not await asyncio.to_thread(self.conn.poll, IDLE_TIMEOUT_S):
            return None
        try:
            return self.conn.recv()
        except EOFError:
            return None

    async def _obey(self, what: str, *args: Any) -> Any:
        if what == "open":
            return await self._open(*args)
        if what == "ready":
            return await self._ready(*args)
        if what == "begin":
            self.cpu_at_begin = _cpu_s()
            return True
        if what == "serve":
            return await self._serve_wave(*args)
        if what == "finish":
            return await self._finish()
        if what == "close":
            await self._close()
            return True
        raise ValueError(f"unknown command {what!r}")

    async def _open(self, run: EngineRun) -> str | None:
        await self._close()
        self.run = run
        tiers = [] if run.tier is None else [run.tier]
        extra = {"cpu_bytes_to_use": run.primary_bytes, "secondary_tiers": tiers}
        config = OffloadingConfig(
            engine_id=f"fleet{self.index}-{uuid.uuid4().hex[:8]}",
            kv_bytes_per_block=run.chunk_bytes,
            tokens_per_block=TOKENS_PER_BLOCK,
            model_name=run.model,
            kv_dtype="int64",
            extra_config=with_spec_name(extra),
        )
        blocks = run.in_flight * run.max_prompt_chunks
        caches = kv_caches(BenchSettings(chunk_bytes=run.chunk_bytes), blocks)
        self.kv = await KVTier.open(config, caches, engine=copy_engine())
        self.engine = Engine(self.kv, caches, blocks, run.lookup_timeout_s)
        peer = self._peer_tier()
        return None if peer is None else peer.listen_address

    def _peer_tier(self) -> PeerTier | None:
        tiers = [] if self.kv is None else self.kv.manager.tiers
        return next((tier for tier in tiers if isinstance(tier, PeerTier)), None)

    async def _ready(self, peers: int, timeout: float) -> bool:
        """Wait until a p2p tier reads from ``peers`` peers and serves as many."""
        peer = self._peer_tier()
        if peer is None:
            return True
        deadline = time.monotonic() + timeout
        while len(peer.connected_peers) < peers or peer.inbound_peers < peers:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def _serve_wave(self, requests: Sequence[tuple[str, tuple[int, ...]]]) -> list[Any]:
        engine = self.engine
        assert engine is not None, "serve before open"
        served = await asyncio.gather(
            *(engine.serve(BenchRequest(req_id, blocks)) for req_id, blocks in requests)
        )
        return [asdict(one) for one in served]

    async def _finish(self) -> dict[str, Any]:
        """Wait for the cascades, then everything measured of this engine's run."""
        kv, run = self.kv, self.run
        assert kv is not None and run is not None, "finish before open"
        await kv.drain()
        cpu_s = _cpu_s() - self.cpu_at_begin
        kv.manager.on_schedule_end()
        diagnostics = kv.manager.diagnostics
        stats = diagnostics.tier_stats()
        primary = stats[next(iter(stats))]
        established, listening = tcp_sockets()
        figures: dict[str, Any] = {
            "cpu_s": cpu_s,
            "tier": {name: 0.0 for name in primary},
            "primary": primary,
            "tcp_established": established,
            "tcp_listening": listening,
            "rss_bytes": process_rss_bytes("self"),
            "metrics": {},
        }
        if run.tier is not None:
            figures["tier"] = stats[diagnostics.tier_labels[0]]
            figures["metrics"] = self._tier_metrics(str(run.tier["type"]))
        peer = self._peer_tier()
        if peer is not None:
            figures["p2p"] = {
                "outbound": len(peer.connected_peers),
                "inbound": peer.inbound_peers,
                "indexed_keys": peer.indexed_keys,
                "announced_keys": peer.announced_keys,
            }
        return figures

    def _tier_metrics(self, tier_type: str) -> dict[str, float]:
        """Every sample of the tier's own metrics (``kvtier_<type>_*``), by name and
        labels: whatever the tier exports, including metrics added after this file."""
        assert self.kv is not None
        prefix = f"kvtier_{tier_type}_"
        samples: dict[str, float] = {}
        for family in self.kv.registry.collect():
            for sample in family.samples:
                if not sample.name.startswith(prefix) or sample.name.endswith("_created"):
                    continue
                labels = ",".join(
                    f"{name}={value}"
                    for name, value in sorted(sample.labels.items())
                    if name != "tier"
                )
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    async def _close(self) -> None:
        engine, kv = self.engine, self.kv
        self.engine = self.kv = None
        if engine is not None:
            await engine.aclose()
        if kv is not None:
            await kv.aclose()
