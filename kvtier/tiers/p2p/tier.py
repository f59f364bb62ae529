""":class:`PeerTier`: the p2p tier as the framework sees it.

The tier keeps no bytes of its own: ``store`` announces, ``on_primary_removed``
withdraws, ``contains``/``lookup`` probe the peer index and ``load`` pulls chunks from
the peers that announced them. The connections themselves live in
:mod:`~kvtier.tiers.p2p.reader` and :mod:`~kvtier.tiers.p2p.owner`.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio.to_thread

from kvtier.errors import ConfigError
from kvtier.format import ChunkFormat
from kvtier.keys import OffloadKey
from kvtier.metrics import CounterDef, GaugeDef, MetricDefinition
from kvtier.records import Locality, Medium, OffloadingEvent
from kvtier.resources import TaskSet
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob
from kvtier.tiers.kit import EventLog, ThrottledLog
from kvtier.tiers.p2p.channel import Listener, Transport, format_address
from kvtier.tiers.p2p.context import (
    ANNOUNCE_BYTES,
    ANNOUNCE_FRAMES,
    ANNOUNCE_KEYS,
    AUTH_FAILURES,
    CONNECTIONS,
    CORRUPT_BACKOFFS,
    CORRUPT_RECOVERIES,
    CORRUPT_REPORTS,
    FRAMES_REJECTED,
    INDEX_MEMORY,
    INDEXED_KEYS,
    REVERIFIED_CHUNKS,
    SERVED_CHUNKS,
    Node,
    NodeMetrics,
)
from kvtier.tiers.p2p.handshake import NODE_ID_BYTES, Credentials
from kvtier.tiers.p2p.index import Announcer, PeerIndex
from kvtier.tiers.p2p.owner import Server
from kvtier.tiers.p2p.reader import Dialer, Link, fetch_chunks
from kvtier.tiers.p2p.settings import PeerSettings, read_secret_file
from kvtier.tiers.p2p.sockets import SocketTransport

__all__ = ["PeerTier"]

logger = logging.getLogger(__name__)

# Listen for a few times as many connections as may be served at once: a burst of
# redials after a restart waits in the backlog instead of being refused.
_BACKLOG_PER_INBOUND = 4
_INDEX_TRAFFIC_LABELS = ("tier", "flow", "change")


class PeerTier(SecondaryTier):
    """Shares this node's primary tier with peers and reads theirs.

    Built from its effective :class:`~kvtier.tiers.p2p.settings.PeerSettings`
    (:meth:`effective_settings`). ``transport`` (not a configuration key) replaces the
    TCP transport, e.g. with :class:`~kvtier.tiers.p2p.memory.MemoryTransport` in tests;
    ``clock`` (seconds, ``time.monotonic`` by default) times the back-off of a peer's
    copy of a key after it failed verification.
    """

    medium = Medium.NETWORK  # its hits are P2P ones
    locality = Locality.REMOTE
    keeps_copies = False  # its chunks are those of the primary tier
    settings_class = PeerSettings

    def __init__(
        self,
        ctx: TierContext,
        settings: PeerSettings,
        *,
        transport: Transport | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(ctx)
        # Filled in by effective_settings, from which the framework builds the tier.
        assert settings.max_frame_bytes is not None
        self.settings = settings
        self.max_frame_bytes = settings.max_frame_bytes
        self._transport = SocketTransport() if transport is None else transport
        self._node_id = secrets.token_bytes(NODE_ID_BYTES)
        self._index: PeerIndex[Link] = PeerIndex(
            retry_after_s=settings.retry_corrupt_after_s,
            retry_max_s=settings.retry_corrupt_max_s,
            clock=time.monotonic if clock is None else clock,
        )
        self._announcer = Announcer()
        self._metrics = NodeMetrics(ctx)
        self._events = EventLog(ctx.enable_events)
        self._tasks = TaskSet(f"tier {ctx.tier_name}")
        self._listener: Listener | None = None
        self._server: Server | None = None
        self._dialers: list[Dialer] = []
        self._closed = False

    def __repr__(self) -> str:
        peers = [format_address(peer) for peer in self.settings.peers]
        return (
            f"PeerTier({self.ctx.tier_name!r}, listen={self.listen_address!r}, "
            f"peers={peers!r}, tls={self.settings.tls is not None})"
        )

    @classmethod
    def effective_settings(
        cls, settings: Any, *, chunk_bytes: int, job_timeout_s: float, path: str
    ) -> PeerSettings:
        """The settings with ``max_frame_bytes`` as the tier derives it from the chunk
        size (checked to hold one chunk frame)."""
        given: PeerSettings = settings
        return given.for_chunks(chunk_bytes, path)

    @classmethod
    def build_metric_definitions(cls, settings: Any) -> dict[str, MetricDefinition]:
        return {
            CONNECTIONS: GaugeDef(
                "Authenticated p2p connections, by tier and direction (inbound: peers "
                "reading from this node; outbound: peers this node reads from).",
                ("tier", "direction"),
            ),
            AUTH_FAILURES: CounterDef(
                "p2p connections that failed authentication (wrong secret, namespace or "
                "certificate, or anything but the handshake first), by tier.",
                ("tier",),
            ),
            FRAMES_REJECTED: CounterDef(
                "Authenticated p2p connections closed for a malformed or oversized frame, by tier.",
                ("tier",),
            ),
            INDEXED_KEYS: GaugeDef("Keys some peer announced to this node, by tier.", ("tier",)),
            SERVED_CHUNKS: CounterDef("Chunks this node sent to peers, by tier.", ("tier",)),
            INDEX_MEMORY: GaugeDef(
                "Estimated memory of the index of what peers announced to this node, in "
                "bytes (its tables, key objects and holder tuples, by sys.getsizeof), by tier.",
                ("tier",),
            ),
            ANNOUNCE_FRAMES: CounterDef(
                "ANNOUNCE and WITHDRAW frames, by tier, flow (sent: this node told its "
                "readers; received: a peer told this node) and change (announce, withdraw).",
                _INDEX_TRAFFIC_LABELS,
            ),
            ANNOUNCE_KEYS: CounterDef(
                "Keys announced or withdrawn in those frames, by tier, flow and change.",
                _INDEX_TRAFFIC_LABELS,
            ),
            ANNOUNCE_BYTES: CounterDef(
                "Bytes of those frames on the wire, headers included (before TLS), by "
                "tier, flow and change.",
                _INDEX_TRAFFIC_LABELS,
            ),
            CORRUPT_REPORTS: CounterDef(
                "Keys whose chunks failed verification on a reader, as reported to their "
                "owner, by tier and flow (sent: this node reported; received: a peer "
                "reported to this node).",
                ("tier", "flow"),
            ),
            REVERIFIED_CHUNKS: CounterDef(
                "Rows this node re-checked after a peer reported their chunks corrupt, by "
                "tier and verdict (intact: the row matches its checksum from store time and "
                "stays announced; damaged: it changed and was withdrawn).",
                ("tier", "verdict"),
            ),
            CORRUPT_BACKOFFS: CounterDef(
                "Times a peer's copy of a key was set aside after its chunk failed "
                "verification (retry_corrupt_after_s, doubling), by tier.",
                ("tier",),
            ),
            CORRUPT_RECOVERIES: CounterDef(
                "Keys loaded intact from a peer whose copy had failed verification before "
                "(its back-off ended), by tier.",
                ("tier",),
            ),
        }

    # ------------------------------------------------------------ properties

    @property
    def address(self) -> tuple[str, int]:
        """The bound listening address ``(host, port)`` (the real port when 0 was asked)."""
        if self._listener is None:
            raise RuntimeError(f"tier {self.ctx.tier_name} is not listening")
        return self._listener.address

    @property
    def listen_address(self) -> str:
        """``"host:port"`` as peers would list it: the bound port once started."""
        if self._listener is not None:
            return format_address(self.address)
        return format_address(self.settings.listen)

    @property
    def node_id(self) -> str:
        """This tier instance's random identity, as it appears in peers' logs."""
        return self._node_id.hex()

    @property
    def connected_peers(self) -> list[str]:
        """Peers (as listed in ``peers``) this node is connected to and reading from."""
        return sorted(dialer.peer for dialer in self._dialers if dialer.connected)

    @property
    def inbound_peers(self) -> int:
        """Authenticated peers reading from this node."""
        return 0 if self._server is None else self._server.sessions

    @property
    def indexed_keys(self) -> int:
        """Keys some peer announced (including entries of peers being dropped)."""
        return len(self._index)

    @property
    def backed_off_keys(self) -> int:
        """Peers' copies of keys set aside after failing verification (whether or not
        their wait has run out; a good transfer or a withdrawal forgets one)."""
        return self._index.backed_off

    @property
    def announced_keys(self) -> int:
        """Keys this node announces as held in its primary tier."""
        return len(self._announcer)

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        settings = self.settings
        path = self.ctx.config_path
        secret = settings.secret
        if secret is None:
            assert settings.secret_file is not None
            secret = await anyio.to_thread.run_sync(
                read_secret_file, settings.secret_file, f"{path}.secret_file"
            )
        server_tls = client_tls = None
        if settings.tls is not None:
            server_tls, client_tls = await anyio.to_thread.run_sync(
                settings.tls.contexts, f"{path}.tls"
            )
        chunk_format = ChunkFormat(self.ctx.namespace)
        credentials = Credentials(
            secret, self._node_id, chunk_format.digest, client_tls, server_tls
        )
        if self.ctx.primary is None:
            logger.warning(
                "tier %s cannot pin this node's primary tier: it reads from peers but "
                "answers every fetch with 'missing'",
                self.ctx.tier_name,
            )
        self._listener = await self._listen()
        node = Node(
            tier_name=self.ctx.tier_name,
            credentials=credentials,
            chunk_format=chunk_format,
            index=self._index,
            announcer=self._announcer,
            metrics=self._metrics,
            log=ThrottledLog(logger, f"tier {self.ctx.tier_name}"),
            tasks=self._tasks,
            primary=self.ctx.primary,
            withdraw=self.on_primary_removed,
            report_integrity_failure=self.ctx.report_integrity_failure,
            connect_timeout_s=settings.connect_timeout_s,
            io_timeout_s=settings.io_timeout_s,
            max_frame_bytes=self.max_frame_bytes,
        )
        self._server = Server(node, self._listener, max_inbound=settings.max_inbound_connections)
        self._tasks.spawn(self._server.run(), name="p2p-accept")
        for address in settings.peers:
            dialer = Dialer(
                node,
                self._transport,
                address,
                reconnect_initial_s=settings.reconnect_initial_s,
                reconnect_max_s=settings.reconnect_max_s,
            )
            self._dialers.append(dialer)
            self._tasks.spawn(dialer.run(), name=f"p2p-dial-{dialer.peer}")
        logger.info(
            "tier %s: node %s listening on %s, reading from %d peer(s)%s",
            self.ctx.tier_name,
            self.node_id,
            self.listen_address,
            len(settings.peers),
            " over TLS" if settings.tls is not None else "",
        )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._tasks.aclose()
        listener, self._listener = self._listener, None
        if listener is not None:
            await listener.aclose()

    async def _listen(self) -> Listener:
        path = f"{self.ctx.config_path}.listen"
        host, port = self.settings.listen
        where = format_address((host, port))
        backlog = _BACKLOG_PER_INBOUND * self.settings.max_inbound_connections
        try:
            return await self._transport.listen(host, port, backlog=backlog)
        except socket.gaierror as exc:
            raise ConfigError(path, f"cannot resolve {where}: {exc}") from None
        except OSError as exc:
            raise ConfigError(path, f"cannot listen on {where}: {exc.strerror or exc}") from None

    # ------------------------------------------------------------------- I/O

    def contains(self, key: OffloadKey) -> bool | None:
        return self._index.contains(key)

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        contains = self._index.contains
        return [contains(key) for key in keys]

    async def store(self, job: TransferJob) -> JobResult:
        # The chunks stay in this node's primary tier: announcing them is the store. Their
        # checksums are taken once, now, while the cascade pins the rows: every send reuses
        # them (the sender was the bottleneck, and hashing at send time cost it ~20%), and a
        # byte that changes in this node's memory after now fails the reader's check.
        view = self.ctx.primary_view
        rows = [view[chunk_id] for chunk_id in job.chunk_ids]
        sums = await anyio.to_thread.run_sync(_checksums, rows)
        added = self._announcer.announce(job.keys, sums)
        self._events.add(added, self.medium, False, self.ctx.tier_name)
        # Only announcements crossed the network: no chunk bytes were written anywhere.
        return JobResult(job.job_id, True, transfer_bytes=0)

    def on_primary_removed(self, keys: Sequence[OffloadKey]) -> None:
        removed = self._announcer.withdraw(keys)
        self._events.add(removed, self.medium, True, self.ctx.tier_name)

    def take_events(self) -> list[OffloadingEvent]:
        return self._events.take()

    async def clear(self) -> bool:
        # This node's chunks are its primary tier's (emptying that withdraws them);
        # the chunks read from peers are theirs to keep.
        return True

    async def load(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        views = [view[chunk_id] for chunk_id in job.chunk_ids]
        outcomes = await fetch_chunks(self._index, job.keys, views, self.settings.io_timeout_s)
        loaded = [key for key, result in zip(job.keys, outcomes, strict=True) if result is None]
        if len(loaded) < len(job.keys):
            reasons = sorted({result for result in outcomes if result is not None})
            logger.debug(
                "tier %s: %d of %d chunk(s) of job %d not loaded: %s",
                self.ctx.tier_name,
                len(job.keys) - len(loaded),
                len(job.keys),
                job.job_id,
                "; ".join(reasons),
            )
        return JobResult(job.job_id, len(loaded) == len(job.keys), successful_keys=loaded)


def _checksums(rows: Sequence[memoryview]) -> list[int]:
    return [ChunkFormat.checksum(row) for row in rows]
