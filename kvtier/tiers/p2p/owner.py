"""The owning side: connections peers dial to read this node's primary tier.

A :class:`Server` accepts connections, authenticates each one and serves it as a
:class:`Session`: this node's key set and every later change go out (from the
:class:`~kvtier.tiers.p2p.index.Announcer`), and each FETCH is answered chunk by chunk
from the primary tier, each row pinned until its last byte is out. An accepted
connection only ever parses FETCH requests and CORRUPT reports: it never writes into a
primary slot.

A CORRUPT report names keys whose chunks reached the reader failing verification. The
owner checks each row it still holds against the checksum taken when the key was
stored: a row that changed since is withdrawn (from every reader), one that still
matches stays announced (the chunk was damaged on the way; the reader asks again later).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
from collections import deque

import anyio
import anyio.to_thread

from kvtier.format import HEADER_BYTES, ChunkFormat
from kvtier.keys import OffloadKey
from kvtier.resources import TaskSet
from kvtier.tiers.kit import describe_error
from kvtier.tiers.p2p.channel import Channel, Listener
from kvtier.tiers.p2p.context import (
    AUTH_FAILURES,
    FRAMES_REJECTED,
    SERVED_CHUNKS,
    Change,
    Direction,
    Flow,
    Node,
    Verdict,
)
from kvtier.tiers.p2p.errors import AuthError, LinkError, ProtocolError, SelfConnection
from kvtier.tiers.p2p.handshake import Remote
from kvtier.tiers.p2p.index import Outbox
from kvtier.tiers.p2p.wire import (
    CHUNK_META,
    CONTROL_BATCH_BYTES,
    CORRUPT_SINCE_VERSION,
    FRAME,
    MAX_FETCH_KEYS,
    Kind,
    chunk_body_bytes,
    decode_fetch,
    decode_key_list,
    encode_key_list,
    key_batches,
    parse_frame_header,
    send_frame,
)

__all__ = ["MAX_QUEUED_FETCHES", "Server", "Session"]

logger = logging.getLogger(__name__)

# A reader has one fetch in flight per promotion job (max_concurrent_jobs, 8 by
# default), and reports a corrupt chunk only after one arrived; a backlog of either
# beyond this is a misbehaving peer.
MAX_QUEUED_FETCHES = 1024
# After accept() fails (out of file descriptors, say), wait this long before the next
# try instead of spinning: descriptors free up as connections end.
_ACCEPT_RETRY_S = 0.1


class Session:
    """A connection a peer dialed: this node announces its keys and serves chunks.

    Two tasks: one reads FETCH requests and CORRUPT reports into queues, one writes
    (index changes first, then the reports' re-checks, then one request at a time,
    chunk by chunk). Either ending ends the session.
    """

    def __init__(self, node: Node, channel: Channel, remote: Remote) -> None:
        self.node = node
        self.channel = channel
        self.peer = channel.peer
        self.remote_id = remote.node_id
        #: The protocol version the session speaks.
        self.version = remote.version
        self._wake = asyncio.Event()
        self._outbox = Outbox(self._wake)
        self._fetches: deque[tuple[int, list[OffloadKey]]] = deque()
        self._reports: deque[list[OffloadKey]] = deque()

    async def run(self) -> BaseException | None:
        """Serve until the connection ends; returns the error that ended it, if any."""
        node = self.node
        logger.info(
            "tier %s: peer %s (node %s) reads from this node",
            node.tier_name,
            self.peer,
            self.remote_id.hex(),
        )
        node.announcer.subscribe(self._outbox)
        # Failures are the session's result, reported by the server: not logged here.
        tasks = TaskSet(f"tier {node.tier_name} session {self.peer}", log_failures=False)
        both = [
            tasks.spawn(self._read_requests(), name=f"p2p-requests-{self.peer}"),
            tasks.spawn(self._write(), name=f"p2p-write-{self.peer}"),
        ]
        try:
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        finally:
            node.announcer.unsubscribe(self._outbox)
            await tasks.aclose()
        for task in both:
            if not task.cancelled() and task.exception() is not None:
                return task.exception()
        return None

    async def _read_requests(self) -> None:
        node = self.node
        header = memoryview(bytearray(FRAME.size))
        while True:
            await self.channel.recv_exactly(header)
            kind, length = parse_frame_header(header)
            reports = self.version >= CORRUPT_SINCE_VERSION
            if kind is not Kind.FETCH and not (kind is Kind.CORRUPT and reports):
                raise ProtocolError(f"unexpected {kind.name} frame from a reader")
            if length > node.max_frame_bytes:
                raise ProtocolError(
                    f"a {kind.name} frame of {length} bytes, at most {node.max_frame_bytes}"
                )
            body = bytearray(length)
            with anyio.fail_after(node.io_timeout_s):
                await self.channel.recv_exactly(memoryview(body))
            if len(self._fetches) + len(self._reports) >= MAX_QUEUED_FETCHES:
                raise ProtocolError(f"more than {MAX_QUEUED_FETCHES} requests queued")
            if kind is Kind.FETCH:
                self._fetches.append(decode_fetch(body))
            else:
                keys = decode_key_list(body, 0, MAX_FETCH_KEYS)
                if not keys:
                    raise ProtocolError("a corrupt-chunk report of no keys")
                node.metrics.corrupt_reported(Flow.RECEIVED, len(keys))
                self._reports.append(keys)
            self._wake.set()

    async def _write(self) -> None:
        # Frame header, request id and position, chunk header: one send before each row.
        prefix = memoryview(bytearray(FRAME.size + CHUNK_META.size + HEADER_BYTES))
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                await self._send_index_changes()
                if self._reports:
                    # Before more fetches: a row found damaged is withdrawn, and the
                    # withdrawal goes out, before the next chunk does.
                    await self._recheck(self._reports.popleft())
                    continue
                if not self._fetches:
                    break
                request_id, keys = self._fetches.popleft()
                await self._serve(request_id, keys, prefix)

    async def _send_index_changes(self) -> None:
        node = self.node
        for present, keys in node.announcer.take(self._outbox):
            kind, change = (
                (Kind.ANNOUNCE, Change.ANNOUNCE) if present else (Kind.WITHDRAW, Change.WITHDRAW)
            )
            for batch in key_batches(keys, CONTROL_BATCH_BYTES):
                body = encode_key_list(batch)
                with anyio.fail_after(node.io_timeout_s):
                    await send_frame(self.channel, kind, body)
                node.metrics.index_traffic(Flow.SENT, change, len(batch), FRAME.size + len(body))

    async def _serve(self, request_id: int, keys: list[OffloadKey], prefix: memoryview) -> None:
        """Send each key's chunk (or MISSING), the rows pinned until the last byte is out.

        Each header carries the checksum the tier took when the chunk was announced
        (``PeerTier.store``); a chunk announced before that existed is hashed here, on
        the loop (~0.1 ms per 2 MiB). Computing headers on a worker thread while a chunk
        goes out was measured (benchmarks/p2p_tier.py, 2 cores): it cost 0.06-0.08 s of
        CPU per GiB more in GIL hand-offs than it saved, on the side that is the
        bottleneck.
        """
        node = self.node
        rows = await node.pin(keys)
        served = 0
        meta_end = FRAME.size + CHUNK_META.size
        try:
            for position, key in enumerate(keys):
                row = rows.get(key)
                if row is None:
                    FRAME.pack_into(prefix, 0, Kind.MISSING, CHUNK_META.size)
                    CHUNK_META.pack_into(prefix, FRAME.size, request_id, position)
                    with anyio.fail_after(node.io_timeout_s):
                        await self.channel.send(prefix[:meta_end])
                    continue
                FRAME.pack_into(prefix, 0, Kind.CHUNK, chunk_body_bytes(len(row)))
                CHUNK_META.pack_into(prefix, FRAME.size, request_id, position)
                checksum = node.announcer.checksum(key)
                node.chunk_format.pack_header(prefix[meta_end:], key, row, checksum)
                with anyio.fail_after(node.io_timeout_s):
                    await self.channel.send(prefix, row)
                served += 1
        finally:
            node.unpin(list(rows))
            if served:
                node.metrics.count(SERVED_CHUNKS, served)

    async def _recheck(self, keys: list[OffloadKey]) -> None:
        """Check the rows of reported ``keys`` against their checksums from store time;
        withdraw the keys whose rows changed. Keys this node no longer holds are
        skipped: their withdrawal is already on its way."""
        node = self.node
        rows = await node.pin(keys)
        try:
            expected = {key: node.announcer.checksum(key) for key in rows}
            held = [key for key in keys if expected.get(key) is not None]
            sums = await anyio.to_thread.run_sync(_checksums, [rows[key] for key in held])
        finally:
            node.unpin(list(rows))
        damaged = [key for key, now in zip(held, sums, strict=True) if now != expected[key]]
        node.metrics.reverified(Verdict.INTACT, len(held) - len(damaged))
        node.metrics.reverified(Verdict.DAMAGED, len(damaged))
        if damaged:
            node.withdraw(damaged)
            node.log.warning(
                "damaged",
                "withdrew %d key(s) whose rows changed since they were stored (reported by "
                "peer %s)",
                len(damaged),
                self.peer,
            )
        elif held:
            # The reader's warning already says a chunk failed; this says where.
            logger.debug(
                "tier %s: peer %s reported %d corrupt chunk(s); the rows here are intact "
                "(damaged on the way)",
                node.tier_name,
                self.peer,
                len(held),
            )


def _checksums(rows: list[memoryview]) -> list[int]:
    return [ChunkFormat.checksum(row) for row in rows]


class Server:
    """Accepts readers on a listener and serves each authenticated one as a session.

    At most ``max_inbound`` accepted connections at once, authenticated or not; more
    are closed on arrival.
    """

    def __init__(self, node: Node, listener: Listener, *, max_inbound: int) -> None:
        self.node = node
        self._listener = listener
        self._max_inbound = max_inbound
        self._inbound = 0
        self._sessions = 0

    @property
    def sessions(self) -> int:
        """Authenticated peers reading from this node."""
        return self._sessions

    async def run(self) -> None:
        """Accept until cancelled; each connection is served as a task of the node's."""
        node = self.node
        while True:
            try:
                accepted = await self._listener.accept()
            except OSError as exc:
                node.log.warning("accept", "accepting a connection failed: %s", exc)
                await asyncio.sleep(_ACCEPT_RETRY_S)
                continue
            if self._inbound >= self._max_inbound:
                accepted.close()
                node.log.warning(
                    "busy",
                    "refused %s: %d connections already (max_inbound_connections)",
                    accepted.peer,
                    self._inbound,
                )
                continue
            self._inbound += 1
            task = node.tasks.spawn(self._serve(accepted), name=f"p2p-serve-{accepted.peer}")
            # In a callback, not the coroutine's ``finally``: a task cancelled before its
            # first step never runs its body, and the channel must be closed all the same.
            task.add_done_callback(functools.partial(self._ended, accepted))

    def _ended(self, channel: Channel, task: asyncio.Task[None]) -> None:
        self._inbound -= 1
        channel.close()

    async def _serve(self, accepted: Channel) -> None:
        node = self.node
        label = accepted.peer
        try:
            with anyio.fail_after(node.connect_timeout_s):
                channel, remote = await node.credentials.as_owner(accepted)
        except SelfConnection:
            return
        except (AuthError, ssl.SSLError, TimeoutError) as exc:
            node.metrics.count(AUTH_FAILURES)
            node.log.warning("auth", "refused a connection from %s: %s", label, describe_error(exc))
            return
        except (OSError, LinkError) as exc:
            logger.debug(
                "tier %s: %s left during the handshake: %s",
                node.tier_name,
                label,
                describe_error(exc),
            )
            return
        try:
            error = await self._run_session(Session(node, channel, remote))
        finally:
            channel.close()
        if isinstance(error, ProtocolError):
            node.metrics.count(FRAMES_REJECTED)
            node.log.warning("protocol", "closed the connection of %s: %s", label, error)
        elif error is not None:
            logger.info(
                "tier %s: peer %s stopped reading from this node: %s",
                node.tier_name,
                label,
                describe_error(error),
            )

    async def _run_session(self, session: Session) -> BaseException | None:
        self._sessions += 1
        self.node.metrics.connection_opened(Direction.INBOUND)
        try:
            return await session.run()
        finally:
            self._sessions -= 1
            self.node.metrics.connection_closed(Direction.INBOUND)
