"""The peer-to-peer tier: kvtier nodes serve each other's primary tiers over TCP.

The tier keeps no bytes of its own. A cascade (``store``) only *announces* to the
connected peers that this node now holds the keys in its primary tier; an eviction
(``on_primary_removed``) withdraws them. Each node keeps an index of what every peer
announced, so ``contains`` and ``lookup`` are dictionary probes. A promotion (``load``)
asks a peer that announced the key for it; the peer pins the chunk in its primary tier
while it sends a :class:`~kvtier.tiers._format.ChunkFormat` header (with the checksum
taken when the chunk was stored) and the row, which the requester receives straight
into the destination primary slot and verifies before it reports the key loaded.

Connections (see :mod:`kvtier.tiers.p2p.protocol` for the wire format). Each node
listens on ``listen`` and dials every entry of ``peers``. A connection has one purpose,
set by who dialed it: the dialing node *reads* (it receives the other's announcements
and pulls chunks), the accepting node *owns* (it announces and serves). Two nodes that
list each other hold two connections, one per direction. This was chosen over one
shared connection per pair because:

- nothing can race: two nodes dialing each other at once is the normal case, not a
  duplicate to detect and tear down by a tie-break rule;
- an accepted connection, the one a stranger can open, parses only FETCH requests and
  never writes into a primary slot: the receive path into the region exists only on
  connections this node chose to dial;
- ``peers`` reads as "the nodes whose primary tiers I read", so one-way topologies
  (a node that only serves, a node that only reads) need no extra setting;
- reconnecting and resynchronising live only in the dialer: every new connection
  starts with the owner's full key set, then its changes in order.

Every connection authenticates first (an HMAC-SHA256 challenge-response over the shared
secret, in both directions), optionally inside mutual TLS. A frame the state does not
allow, a malformed or oversized one, a failed proof or a namespace mismatch closes that
connection only.

Threads: ``contains`` runs on the scheduler's thread and ``on_primary_removed`` is
called there under the manager lock, while everything else runs on the tier event
loop. The peer index and the announced-key set each have a lock held only for dict and
set operations; announcements reach the loop through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import secrets
import socket
import ssl
import time
from collections import deque
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from kvtier.errors import ConfigError
from kvtier.keys import OffloadKey
from kvtier.metrics import CounterDef, GaugeDef, MetricDefinition
from kvtier.records import EventLog, Medium, OffloadingEvent
from kvtier.tiers._format import HEADER_BYTES, ChunkFormat
from kvtier.tiers.base import JobResult, PrimaryAccess, SecondaryTier, TierContext, TransferJob
from kvtier.tiers.p2p.channel import Channel, Listener, Transport, format_address
from kvtier.tiers.p2p.errors import (
    AuthError,
    LinkError,
    PeerClosed,
    ProtocolError,
    Reject,
    Rejected,
    SelfConnection,
)
from kvtier.tiers.p2p.handshake import Credentials
from kvtier.tiers.p2p.index import Announcer, Outbox, PeerIndex
from kvtier.tiers.p2p.settings import PeerSettings, read_secret_file
from kvtier.tiers.p2p.sockets import SocketTransport
from kvtier.tiers.p2p.wire import (
    CHUNK_META,
    CONTROL_BATCH_BYTES,
    FRAME,
    MAX_FETCH_KEYS,
    Kind,
    chunk_body_bytes,
    decode_fetch,
    decode_key_list,
    encode_fetch,
    encode_key_list,
    fetch_batches,
    key_batches,
    parse_frame_header,
    send_frame,
)

__all__ = ["PeerTier"]

logger = logging.getLogger(__name__)

CONNECTIONS = "kvtier_p2p_connections"
AUTH_FAILURES = "kvtier_p2p_auth_failures"
FRAMES_REJECTED = "kvtier_p2p_frames_rejected"
INDEXED_KEYS = "kvtier_p2p_indexed_keys"
SERVED_CHUNKS = "kvtier_p2p_served_chunks"

# A reader has one fetch in flight per promotion job (max_concurrent_jobs, 8 by
# default); a backlog beyond this is a misbehaving peer.
MAX_QUEUED_FETCHES = 1024
# The same problem (bad handshakes from some address, refused connections) is logged at
# most this often, with a count of the occurrences in between.
_LOG_INTERVAL_S = 10.0
_PENDING = "pending"

_T = TypeVar("_T")


class PeerTier(SecondaryTier):
    """Shares this node's primary tier with peers and reads theirs.

    Parameters (see the module docstring and README for the protocol):

    ``listen`` (``"host:port"``, default ``"127.0.0.1:0"``; port 0 picks a free port,
    see :attr:`address`); ``peers`` (list of ``"host:port"`` to read from);
    ``secret`` or ``secret_file`` (exactly one: the shared secret, at least 16 bytes; a
    file must not be accessible to group or others); ``tls`` (``{"cert", "key", "ca",
    "check_hostname"}``: mutual TLS, both sides present a certificate signed by ``ca``);
    ``connect_timeout_s`` (5); ``io_timeout_s`` (10); ``max_frame_bytes`` (one chunk
    frame + 64 KiB); ``reconnect_initial_s`` / ``reconnect_max_s`` (0.1 / 5);
    ``max_inbound_connections`` (64).
    """

    medium = Medium.NETWORK
    locality = "remote"
    settings_class = PeerSettings

    def __init__(
        self, ctx: TierContext, *, transport: Transport | None = None, **params: Any
    ) -> None:
        super().__init__(ctx)
        self._transport = SocketTransport() if transport is None else transport
        self.settings = PeerSettings.from_params(params, ctx.config_path)
        settings = self.settings
        self._listen_host, self._listen_port = settings.listen
        self._peers = list(settings.peers)
        self._secret_file = settings.secret_file
        self._secret = settings.secret
        self._tls = settings.tls
        self.connect_timeout_s = settings.connect_timeout_s
        self.io_timeout_s = settings.io_timeout_s
        self.max_frame_bytes = settings.frame_limit(ctx.chunk_bytes, ctx.config_path)
        self.reconnect_initial_s = settings.reconnect_initial_s
        self.reconnect_max_s = settings.reconnect_max_s
        self.max_inbound_connections = settings.max_inbound_connections

        self._format = ChunkFormat(ctx.namespace)
        self._node_id = secrets.token_bytes(16)
        self._index: PeerIndex[_Link] = PeerIndex()
        self._announcer = Announcer()
        self._events = EventLog(ctx.enable_events)
        self._tasks = _TaskSet(ctx.tier_name)
        self._throttle = _Throttle()
        self._links: dict[str, _Link] = {}
        self._sessions: set[_Session] = set()
        self._inbound = 0
        self._listener: Listener | None = None
        self._credentials: Credentials | None = None
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"PeerTier({self.ctx.tier_name!r}, listen={self.listen_address!r}, "
            f"peers={[_label(peer) for peer in self._peers]!r}, tls={self._tls is not None})"
        )

    @classmethod
    def build_metric_definitions(
        cls, tier_config: Mapping[str, Any]
    ) -> dict[str, MetricDefinition]:
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
            return _label(self.address)
        return _label((self._listen_host, self._listen_port))

    @property
    def node_id(self) -> str:
        """This tier instance's random identity, as it appears in peers' logs."""
        return self._node_id.hex()

    @property
    def connected_peers(self) -> list[str]:
        """Peers (as listed in ``peers``) this node is connected to and reading from."""
        return sorted(label for label, link in self._links.items() if link.live)

    @property
    def inbound_peers(self) -> int:
        """Authenticated peers reading from this node."""
        return len(self._sessions)

    @property
    def indexed_keys(self) -> int:
        """Keys some peer announced (including entries of peers being dropped)."""
        return len(self._index)

    @property
    def announced_keys(self) -> int:
        """Keys this node announces as held in its primary tier."""
        return len(self._announcer)

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._secret is None:
            assert self._secret_file is not None
            self._secret = await anyio.to_thread.run_sync(
                read_secret_file, self._secret_file, f"{self.ctx.config_path}.secret_file"
            )
        server_tls = client_tls = None
        if self._tls is not None:
            server_tls, client_tls = await anyio.to_thread.run_sync(
                self._tls.contexts, f"{self.ctx.config_path}.tls"
            )
        self._credentials = Credentials(
            self._secret, self._node_id, self._format.digest, client_tls, server_tls
        )
        if self.ctx.primary is None:
            logger.warning(
                "tier %s cannot pin this node's primary tier: it reads from peers but "
                "answers every fetch with 'missing'",
                self.ctx.tier_name,
            )
        self._listener = await self._bind()
        self._tasks.spawn(self._accept_loop(), "p2p-accept")
        for peer in self._peers:
            self._tasks.spawn(self._dial_forever(peer), f"p2p-dial-{_label(peer)}")
        logger.info(
            "tier %s: node %s listening on %s, reading from %d peer(s)%s",
            self.ctx.tier_name,
            self.node_id,
            self.listen_address,
            len(self._peers),
            " over TLS" if self._tls is not None else "",
        )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._tasks.cancel_and_wait()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._publish_connections()

    async def _bind(self) -> Listener:
        path = f"{self.ctx.config_path}.listen"
        where = _label((self._listen_host, self._listen_port))
        try:
            return await self._transport.listen(
                self._listen_host,
                self._listen_port,
                backlog=4 * self.max_inbound_connections,
            )
        except socket.gaierror as exc:
            raise ConfigError(path, f"cannot resolve {where}: {exc}") from None
        except OSError as exc:
            raise ConfigError(path, f"cannot listen on {where}: {exc.strerror or exc}") from None

    # ---------------------------------------------------------------- lookups

    def contains(self, key: OffloadKey) -> bool | None:
        return self._index.contains(key)

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        contains = self._index.contains
        return [contains(key) for key in keys]

    # ----------------------------------------------------------------- stores

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

    # ------------------------------------------------------------------ loads

    async def load(self, job: TransferJob) -> JobResult:
        outcomes: list[str | None] = ["no live peer holds it"] * len(job.keys)
        plan: dict[_Link, list[int]] = {}
        for position, key in enumerate(job.keys):
            link = self._index.pick(key)
            if link is not None:
                plan.setdefault(link, []).append(position)
        view = self.ctx.primary_view
        requests: list[tuple[_Request, list[int]]] = []
        try:
            for link, positions in plan.items():
                for part in fetch_batches(job.keys, positions):
                    keys = [job.keys[p] for p in part]
                    views = [view[job.chunk_ids[p]] for p in part]
                    requests.append((await link.fetch(keys, views), part))
            await self._await_requests([request for request, _ in requests])
        finally:
            for request, _ in requests:
                if not request.finished.done():
                    # The reader may be receiving into one of this job's slots: stop it
                    # before the framework hands the slots to anyone else.
                    request.link.abort("a load stopped waiting for its chunks")
        for request, part in requests:
            for position, result in zip(part, request.results, strict=True):
                outcomes[position] = result
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

    async def _await_requests(self, requests: list[_Request]) -> None:
        """Wait for every request; a link that sends nothing for io_timeout_s is aborted."""
        loop = asyncio.get_running_loop()
        check_every = min(1.0, self.io_timeout_s / 4)
        pending = {request.finished for request in requests if not request.finished.done()}
        while pending:
            _, pending = await asyncio.wait(pending, timeout=check_every)
            now = loop.time()
            for request in requests:
                if request.finished.done():
                    continue
                quiet = now - max(request.link.last_rx, request.sent_at)
                if quiet > self.io_timeout_s:
                    request.link.abort(f"no data for {self.io_timeout_s:g} s")

    # ----------------------------------------------------------- the dialers

    async def _dial_forever(self, peer: tuple[str, int]) -> None:
        label = _label(peer)
        failures = 0
        while True:
            try:
                link = await self._connect(peer, label)
            except (SelfConnection, Rejected) as exc:
                if isinstance(exc, Rejected) and exc.reason is not Reject.SELF:
                    self._count(AUTH_FAILURES)
                    failures += 1
                    self._dial_failed(label, failures, exc)
                else:
                    logger.info("tier %s: peer %s is this node itself", self.ctx.tier_name, label)
                    return
            except (AuthError, ssl.SSLError) as exc:
                self._count(AUTH_FAILURES)
                failures += 1
                self._dial_failed(label, failures, exc)
            except (OSError, LinkError) as exc:
                failures += 1
                self._dial_failed(label, failures, exc)
            else:
                if failures:
                    logger.info(
                        "tier %s: peer %s reachable again after %d failed attempt(s)",
                        self.ctx.tier_name,
                        label,
                        failures,
                    )
                failures = 0
                await self._run_link(link)
            await asyncio.sleep(self._backoff(failures))

    def _backoff(self, failures: int) -> float:
        step = min(self.reconnect_max_s, self.reconnect_initial_s * 2.0 ** max(0, failures - 1))
        return step * random.uniform(0.5, 1.0)

    def _dial_failed(self, label: str, failures: int, exc: BaseException) -> None:
        # The first failure of a run is worth a warning; the retries that follow are not.
        log = logger.warning if failures == 1 else logger.debug
        log(
            "tier %s: cannot read from peer %s (attempt %d): %s",
            self.ctx.tier_name,
            label,
            failures,
            _describe(exc),
        )

    async def _connect(self, peer: tuple[str, int], label: str) -> _Link:
        host, port = peer
        assert self._credentials is not None
        with anyio.fail_after(self.connect_timeout_s):
            opened = await self._transport.connect(host, port)
            try:
                channel, remote_id = await self._credentials.as_reader(opened, host)
            except BaseException:
                opened.close()
                raise
        return _Link(self, label, channel, remote_id)

    async def _run_link(self, link: _Link) -> None:
        self._links[link.peer] = link
        self._publish_connections()
        logger.info(
            "tier %s: reading from peer %s (node %s)",
            self.ctx.tier_name,
            link.peer,
            link.remote_id.hex(),
        )
        reader = asyncio.get_running_loop().create_task(
            link.read_loop(), name=f"p2p-read-{link.peer}"
        )
        link.reader = reader
        try:
            await asyncio.wait({reader})
        finally:
            reader.cancel()
            await asyncio.wait({reader})
            error = None if reader.cancelled() else reader.exception()
            reason = _describe(error) if error is not None else link.end_reason or "closing"
            link.abort(reason)
            link.channel.close()
            if self._links.get(link.peer) is link:
                del self._links[link.peer]
            self._publish_connections()
            if isinstance(error, ProtocolError):
                self._count(FRAMES_REJECTED)
            if not self._closed:
                quiet = isinstance(error, PeerClosed)
                (logger.info if quiet else logger.warning)(
                    "tier %s: lost peer %s: %s", self.ctx.tier_name, link.peer, reason
                )
                await self._index.drop(link)
                self._publish_index()

    # ------------------------------------------------------------ the server

    async def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                accepted = await self._listener.accept()
            except OSError as exc:
                # EMFILE and friends: wait for descriptors to free up instead of spinning.
                self._throttle.warning(
                    "accept", "tier %s: accepting a connection failed: %s", self.ctx.tier_name, exc
                )
                await asyncio.sleep(0.1)
                continue
            label = accepted.peer
            if self._inbound >= self.max_inbound_connections:
                accepted.close()
                self._throttle.warning(
                    "busy",
                    "tier %s: refused %s: %d connections already (max_inbound_connections)",
                    self.ctx.tier_name,
                    label,
                    self._inbound,
                )
                continue
            self._inbound += 1
            task = self._tasks.spawn(self._serve_connection(accepted), f"p2p-serve-{label}")
            # In a callback, not the coroutine's ``finally``: a task cancelled before its
            # first step never runs its body, and the channel must be closed all the same.
            task.add_done_callback(functools.partial(self._connection_ended, accepted))

    def _connection_ended(self, channel: Channel, task: asyncio.Task[None]) -> None:
        self._inbound -= 1
        channel.close()

    async def _serve_connection(self, accepted: Channel) -> None:
        label = accepted.peer
        channel: Channel | None = None
        try:
            try:
                with anyio.fail_after(self.connect_timeout_s):
                    assert self._credentials is not None
                    channel, remote_id = await self._credentials.as_owner(accepted)
            except SelfConnection:
                return
            except (AuthError, ssl.SSLError, TimeoutError) as exc:
                self._count(AUTH_FAILURES)
                self._throttle.warning(
                    "auth",
                    "tier %s: refused a connection from %s: %s",
                    self.ctx.tier_name,
                    label,
                    _describe(exc),
                )
                return
            except (OSError, LinkError) as exc:
                logger.debug(
                    "tier %s: %s left during the handshake: %s",
                    self.ctx.tier_name,
                    label,
                    _describe(exc),
                )
                return
            session = _Session(self, channel, label, remote_id)
            self._sessions.add(session)
            self._publish_connections()
            try:
                error = await session.run()
            finally:
                self._sessions.discard(session)
                self._publish_connections()
            if isinstance(error, ProtocolError):
                self._count(FRAMES_REJECTED)
                self._throttle.warning(
                    "protocol",
                    "tier %s: closed the connection of %s: %s",
                    self.ctx.tier_name,
                    label,
                    error,
                )
            elif error is not None:
                logger.info(
                    "tier %s: peer %s stopped reading from this node: %s",
                    self.ctx.tier_name,
                    label,
                    _describe(error),
                )
        finally:
            if channel is not None:
                channel.close()

    # -------------------------------------------------------------- helpers

    def _count(self, name: str, amount: int = 1) -> None:
        self.ctx.metrics.inc(name, amount, (self.ctx.tier_name,))

    def _publish_connections(self) -> None:
        outbound = sum(1 for link in self._links.values() if link.live)
        self.ctx.metrics.set(CONNECTIONS, outbound, (self.ctx.tier_name, "outbound"))
        self.ctx.metrics.set(CONNECTIONS, len(self._sessions), (self.ctx.tier_name, "inbound"))

    def _publish_index(self) -> None:
        self.ctx.metrics.set(INDEXED_KEYS, len(self._index), (self.ctx.tier_name,))

    def _integrity_failure(self, peer: str, key: OffloadKey, problem: str) -> None:
        self.ctx.report_integrity_failure(1)
        self._throttle.warning(
            "integrity",
            "tier %s: a chunk from peer %s failed verification (%s); not served",
            self.ctx.tier_name,
            peer,
            problem,
        )

    async def _pin(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, memoryview]:
        """Pin ``keys`` in this node's primary tier; the caller unpins what it got.

        The pin runs as a task of its own and is only shielded from here: if this
        coroutine is cancelled or times out just as the manager answers, the rows it
        would have lost are unpinned when the answer lands.
        """
        primary = self.ctx.primary
        if primary is None:
            return {}
        task: asyncio.Task[dict[OffloadKey, memoryview]] = self._tasks.spawn(
            primary.pin(keys), "p2p-pin"
        )
        try:
            with anyio.fail_after(self.io_timeout_s):
                return await asyncio.shield(task)
        except BaseException:
            task.add_done_callback(lambda done: _unpin_result(primary, done))
            raise


class _Request:
    """One FETCH on one link: which slot each key's chunk goes into, and the outcome."""

    __slots__ = (
        "finished",
        "keys",
        "link",
        "remaining",
        "request_id",
        "results",
        "sent_at",
        "views",
    )

    def __init__(
        self,
        link: _Link,
        request_id: int,
        keys: list[OffloadKey],
        views: list[memoryview],
    ) -> None:
        loop = asyncio.get_running_loop()
        self.link = link
        self.request_id = request_id
        self.keys = keys
        self.views = views
        #: Per key: None (loaded and verified), why it failed, or _PENDING.
        self.results: list[str | None] = [_PENDING] * len(keys)
        self.remaining = len(keys)
        self.finished: asyncio.Future[None] = loop.create_future()
        self.sent_at = loop.time()

    def resolve(self, position: int, outcome: str | None) -> None:
        self.results[position] = outcome
        self.remaining -= 1
        if self.remaining == 0:
            self._finish()

    def fail(self, reason: str) -> None:
        self.results = [reason if result is _PENDING else result for result in self.results]
        self.remaining = 0
        self._finish()

    def _finish(self) -> None:
        # Let go of the slots as soon as the outcome is known.
        self.views = []
        self.link.requests.pop(self.request_id, None)
        if not self.finished.done():
            self.finished.set_result(None)


class _Link:
    """A connection this node dialed: the owner's index comes in, chunks are pulled.

    One task reads (:meth:`read_loop`); loads send FETCH frames under a lock. The reader
    writes into a primary slot only while that slot's request is pending, and
    :meth:`abort` cancels it synchronously: the socket read it was waiting for is
    cancelled before this call returns, so no byte lands in a slot afterwards. (This is
    why reads are bounded with ``anyio.fail_after``, never ``asyncio.wait_for``: the
    latter runs the read in a task of its own, which outlives a cancellation by one
    loop iteration.)
    """

    def __init__(self, tier: PeerTier, peer: str, channel: Channel, remote_id: bytes) -> None:
        self.tier = tier
        self.peer = peer
        self.channel = channel
        self.remote_id = remote_id
        self.live = True
        self.end_reason: str | None = None
        self.requests: dict[int, _Request] = {}
        self.reader: asyncio.Task[None] | None = None
        self.last_rx = asyncio.get_running_loop().time()
        self._next_id = 0
        self._send_lock = asyncio.Lock()

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    async def fetch(self, keys: list[OffloadKey], views: list[memoryview]) -> _Request:
        """Ask the owner for ``keys``; the chunks land in ``views``. Never raises I/O errors:
        a link that fails is aborted, which fails the request."""
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        request = _Request(self, self._next_id, keys, views)
        if not self.live:
            request.fail(f"peer {self.peer} lost: {self.end_reason}")
            return request
        self.requests[request.request_id] = request
        body = encode_fetch(request.request_id, keys)
        try:
            async with self._send_lock:
                with anyio.fail_after(self.tier.io_timeout_s):
                    await send_frame(self.channel, Kind.FETCH, body)
        except (OSError, LinkError) as exc:
            self.abort(f"sending a fetch request failed: {_describe(exc)}")
        except BaseException:
            # Half a frame may have gone out: nothing more can be sent on this stream.
            self.abort("a fetch request was interrupted")
            raise
        return request

    def abort(self, reason: str) -> None:
        """End the link: stop the reader at once and fail every pending request."""
        if not self.live:
            return
        self.live = False
        self.end_reason = reason
        if self.reader is not None:
            self.reader.cancel()
        for request in list(self.requests.values()):
            request.fail(f"peer {self.peer} lost: {reason}")

    async def read_loop(self) -> None:
        """Read frames until the stream ends; raises why it ended."""
        tier = self.tier
        channel = self.channel
        loop = asyncio.get_running_loop()
        header = memoryview(bytearray(FRAME.size))
        meta = memoryview(bytearray(CHUNK_META.size + HEADER_BYTES))
        while True:
            await channel.recv_exactly(header)  # an idle link may wait here forever
            self.last_rx = loop.time()
            kind, length = parse_frame_header(header)
            if length > tier.max_frame_bytes:
                raise ProtocolError(
                    f"a {kind.name} frame of {length} bytes, at most {tier.max_frame_bytes}"
                )
            with anyio.fail_after(tier.io_timeout_s):
                if kind is Kind.CHUNK:
                    await self._receive_chunk(length, meta)
                elif kind is Kind.MISSING:
                    await self._receive_missing(length, meta)
                elif kind is Kind.ANNOUNCE or kind is Kind.WITHDRAW:
                    body = bytearray(length)
                    await channel.recv_exactly(memoryview(body))
                    keys = decode_key_list(body)
                    if kind is Kind.ANNOUNCE:
                        tier._index.add(self, keys)
                    else:
                        tier._index.remove(self, keys)
                    tier._publish_index()
                else:
                    raise ProtocolError(f"unexpected {kind.name} frame from an owner")
            self.last_rx = loop.time()

    def _request_for(self, meta: memoryview) -> tuple[_Request, int]:
        request_id, position = CHUNK_META.unpack_from(meta)
        request = self.requests.get(request_id)
        if (
            request is None
            or position >= len(request.keys)
            or request.results[position] is not _PENDING
        ):
            raise ProtocolError("an answer to nothing this node asked for")
        return request, position

    async def _receive_chunk(self, length: int, meta: memoryview) -> None:
        if length < len(meta):
            raise ProtocolError("truncated chunk frame")
        await self.channel.recv_exactly(meta)
        request, position = self._request_for(meta)
        slot = request.views[position]
        if length != chunk_body_bytes(len(slot)):
            raise ProtocolError(
                f"a chunk of {length - len(meta)} bytes, expected {len(slot)} (another "
                "chunk geometry?)"
            )
        await self.channel.recv_exactly(slot)  # straight into the primary slot
        key = request.keys[position]
        problem = self.tier._format.verify(meta[CHUNK_META.size :], key, slot)
        if problem is not None:
            self.tier._integrity_failure(self.peer, key, problem)
            request.resolve(position, f"corrupt chunk: {problem}")
        else:
            request.resolve(position, None)

    async def _receive_missing(self, length: int, meta: memoryview) -> None:
        if length != CHUNK_META.size:
            raise ProtocolError("malformed missing-chunk frame")
        await self.channel.recv_exactly(meta[: CHUNK_META.size])
        request, position = self._request_for(meta)
        key = request.keys[position]
        request.resolve(position, "the peer no longer holds it")
        self.tier._index.remove(self, [key])
        self.tier._publish_index()


class _Session:
    """A connection a peer dialed: this node announces its keys and serves chunks.

    Two tasks: one reads FETCH requests into a queue, one writes (index changes first,
    then one request at a time, chunk by chunk). Either ending ends the session.
    """

    def __init__(self, tier: PeerTier, channel: Channel, peer: str, remote_id: bytes) -> None:
        self.tier = tier
        self.channel = channel
        self.peer = peer
        self.remote_id = remote_id
        self._wake = asyncio.Event()
        self.outbox = Outbox(self._wake)
        self._fetches: deque[tuple[int, list[OffloadKey]]] = deque()

    async def run(self) -> BaseException | None:
        """Serve until the connection ends; returns the error that ended it, if any."""
        tier = self.tier
        logger.info(
            "tier %s: peer %s (node %s) reads from this node",
            tier.ctx.tier_name,
            self.peer,
            self.remote_id.hex(),
        )
        tier._announcer.subscribe(self.outbox)
        loop = asyncio.get_running_loop()
        tasks = [
            loop.create_task(self._read_requests(), name=f"p2p-requests-{self.peer}"),
            loop.create_task(self._write(), name=f"p2p-write-{self.peer}"),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            tier._announcer.unsubscribe(self.outbox)
            await _stop(tasks)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                return task.exception()
        return None

    async def _read_requests(self) -> None:
        tier = self.tier
        header = memoryview(bytearray(FRAME.size))
        while True:
            await self.channel.recv_exactly(header)
            kind, length = parse_frame_header(header)
            if kind is not Kind.FETCH:
                raise ProtocolError(f"unexpected {kind.name} frame from a reader")
            if length > tier.max_frame_bytes:
                raise ProtocolError(
                    f"a FETCH frame of {length} bytes, at most {tier.max_frame_bytes}"
                )
            body = bytearray(length)
            with anyio.fail_after(tier.io_timeout_s):
                await self.channel.recv_exactly(memoryview(body))
            request = decode_fetch(body, MAX_FETCH_KEYS)
            if len(self._fetches) >= MAX_QUEUED_FETCHES:
                raise ProtocolError(f"more than {MAX_QUEUED_FETCHES} fetch requests queued")
            self._fetches.append(request)
            self._wake.set()

    async def _write(self) -> None:
        # Frame header, request id and position, chunk header: one send before each row.
        prefix = memoryview(bytearray(FRAME.size + CHUNK_META.size + HEADER_BYTES))
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                await self._send_index_changes()
                if not self._fetches:
                    break
                request_id, keys = self._fetches.popleft()
                await self._serve(request_id, keys, prefix)

    async def _send_index_changes(self) -> None:
        tier = self.tier
        for present, keys in tier._announcer.take(self.outbox):
            kind = Kind.ANNOUNCE if present else Kind.WITHDRAW
            for batch in key_batches(keys, CONTROL_BATCH_BYTES):
                with anyio.fail_after(tier.io_timeout_s):
                    await send_frame(self.channel, kind, encode_key_list(batch))

    async def _serve(self, request_id: int, keys: list[OffloadKey], prefix: memoryview) -> None:
        """Send each key's chunk (or MISSING), the rows pinned until the last byte is out.

        Each header carries the checksum :meth:`PeerTier.store` took when the chunk was
        announced; a chunk announced before that existed is hashed here, on the loop
        (~0.1 ms per 2 MiB). Computing headers on a worker thread while a chunk goes out
        was measured (benchmarks/p2p_tier.py, 2 cores): it cost 0.06-0.08 s of CPU per
        GiB more in GIL hand-offs than it saved, on the side that is the bottleneck.
        """
        tier = self.tier
        rows = await tier._pin(keys)
        served = 0
        meta_end = FRAME.size + CHUNK_META.size
        try:
            for position, key in enumerate(keys):
                row = rows.get(key)
                if row is None:
                    FRAME.pack_into(prefix, 0, Kind.MISSING, CHUNK_META.size)
                    CHUNK_META.pack_into(prefix, FRAME.size, request_id, position)
                    with anyio.fail_after(tier.io_timeout_s):
                        await self.channel.send(prefix[:meta_end])
                    continue
                FRAME.pack_into(prefix, 0, Kind.CHUNK, chunk_body_bytes(len(row)))
                CHUNK_META.pack_into(prefix, FRAME.size, request_id, position)
                checksum = tier._announcer.checksum(key)
                tier._format.pack_header(prefix[meta_end:], key, row, checksum)
                with anyio.fail_after(tier.io_timeout_s):
                    await self.channel.send(prefix, row)
                served += 1
        finally:
            if rows:
                assert tier.ctx.primary is not None
                tier.ctx.primary.unpin(list(rows))
            if served:
                tier._count(SERVED_CHUNKS, served)


def _checksums(rows: Sequence[memoryview]) -> list[int]:
    return [ChunkFormat.checksum(row) for row in rows]


class _TaskSet:
    """The tasks a tier owns; :meth:`cancel_and_wait` ends and awaits every one."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, _T], name: str) -> asyncio.Task[_T]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "tier %s: task %s failed",
                self._label,
                task.get_name(),
                exc_info=task.exception(),
            )

    async def cancel_and_wait(self) -> None:
        while self._tasks:
            await _stop(list(self._tasks))


class _Throttle:
    """Logs each kind of recurring problem at most every _LOG_INTERVAL_S, with a count."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < _LOG_INTERVAL_S:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            message += " (and %d more like it since the last report)"
            args = (*args, suppressed)
        logger.warning(message, *args)


# -------------------------------------------------------------- functions


async def _stop(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has finished."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: the owner reports what matters to it


def _unpin_result(primary: PrimaryAccess, task: asyncio.Task[dict[OffloadKey, memoryview]]) -> None:
    if not task.cancelled() and task.exception() is None:
        primary.unpin(list(task.result()))


_label = format_address


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
