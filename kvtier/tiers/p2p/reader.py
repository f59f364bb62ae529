"""The reading side: connections this node dials to read a peer's primary tier.

A :class:`Dialer` keeps one :class:`Link` to one peer: it connects, authenticates,
runs the link until it ends, and redials with backoff. Over a link the owner's index
comes in (ANNOUNCE / WITHDRAW into the :class:`~kvtier.tiers.p2p.index.PeerIndex`) and
chunks are pulled (:func:`fetch_chunks`), straight into primary slots, verified before
they count as loaded.

A chunk that fails verification is a counted integrity failure and a miss, never served.
The key stays in the index: it may have been damaged on the way (a transient fault), so
that peer's copy is only backed off (:meth:`~kvtier.tiers.p2p.index.PeerIndex.back_off`)
and asked for again once the wait runs out. The owner is told (a CORRUPT frame, on
connections of protocol version 2 and later): it re-checks its own row and withdraws
the key if the row itself changed, so every reader drops it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import Sequence

import anyio

from kvtier.format import HEADER_BYTES
from kvtier.keys import OffloadKey
from kvtier.tiers.kit import describe_error
from kvtier.tiers.p2p.channel import Channel, Transport, format_address
from kvtier.tiers.p2p.context import (
    AUTH_FAILURES,
    CORRUPT_BACKOFFS,
    CORRUPT_RECOVERIES,
    FRAMES_REJECTED,
    Change,
    Direction,
    Flow,
    Node,
)
from kvtier.tiers.p2p.errors import (
    AuthError,
    LinkError,
    PeerClosed,
    ProtocolError,
    Reject,
    Rejected,
    SelfConnection,
)
from kvtier.tiers.p2p.handshake import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, Remote
from kvtier.tiers.p2p.index import PeerIndex
from kvtier.tiers.p2p.wire import (
    CHUNK_META,
    CORRUPT_SINCE_VERSION,
    FRAME,
    Kind,
    chunk_body_bytes,
    decode_key_list,
    encode_fetch,
    encode_key_list,
    fetch_batches,
    parse_frame_header,
    send_frame,
)

__all__ = ["Dialer", "Link", "Request", "fetch_chunks"]

logger = logging.getLogger(__name__)

NO_HOLDER = "no live peer holds it"
_PENDING = "pending"


class Request:
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
        self, link: Link, request_id: int, keys: list[OffloadKey], views: list[memoryview]
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

    def pending(self, position: int) -> bool:
        return position < len(self.keys) and self.results[position] is _PENDING

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
        self.link.forget(self)
        if not self.finished.done():
            self.finished.set_result(None)


class Link:
    """A connection this node dialed: the owner's index comes in, chunks are pulled.

    One task reads (started by :meth:`run`); loads send FETCH frames under a lock. The
    reader writes into a primary slot only while that slot's request is pending, and
    :meth:`abort` cancels it synchronously: the read it was waiting for is cancelled
    before this call returns, so no byte lands in a slot afterwards. (This is why reads
    are bounded with ``anyio.fail_after``, never ``asyncio.wait_for``: before Python
    3.12 the latter runs the read in a task of its own, which outlives a cancellation
    by one loop iteration.)
    """

    def __init__(self, node: Node, peer: str, channel: Channel, remote: Remote) -> None:
        self.node = node
        #: The peer as ``peers`` lists it.
        self.peer = peer
        self.channel = channel
        self.remote_id = remote.node_id
        #: The protocol version the link speaks.
        self.version = remote.version
        self.live = True
        self.end_reason: str | None = None
        #: When a byte last came in (loop time): a load gives up on a quiet link.
        self.last_rx = asyncio.get_running_loop().time()
        self._requests: dict[int, Request] = {}
        self._reading: asyncio.Task[None] | None = None
        self._next_id = 0
        self._send_lock = asyncio.Lock()

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    async def fetch(self, keys: list[OffloadKey], views: list[memoryview]) -> Request:
        """Ask the owner for ``keys``; the chunks land in ``views``. Never raises I/O errors:
        a link that fails is aborted, which fails the request."""
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        request = Request(self, self._next_id, keys, views)
        if not self.live:
            request.fail(f"peer {self.peer} lost: {self.end_reason}")
            return request
        self._requests[request.request_id] = request
        body = encode_fetch(request.request_id, keys)
        try:
            async with self._send_lock:
                with anyio.fail_after(self.node.io_timeout_s):
                    await send_frame(self.channel, Kind.FETCH, body)
        except (OSError, LinkError) as exc:
            self.abort(f"sending a fetch request failed: {describe_error(exc)}")
        except BaseException:
            # Half a frame may have gone out: nothing more can be sent on this stream.
            self.abort("a fetch request was interrupted")
            raise
        return request

    def forget(self, request: Request) -> None:
        """``request`` is finished: an answer to it is a protocol error from now on."""
        self._requests.pop(request.request_id, None)

    def abort(self, reason: str) -> None:
        """End the link: stop the reader at once and fail every pending request."""
        if not self.live:
            return
        self.live = False
        self.end_reason = reason
        if self._reading is not None:
            self._reading.cancel()
        for request in list(self._requests.values()):
            request.fail(f"peer {self.peer} lost: {reason}")

    async def run(self) -> BaseException | None:
        """Read until the link ends; returns the error that ended it (None: aborted).

        The link is aborted and its channel closed when this returns or is cancelled.
        """
        reading = asyncio.get_running_loop().create_task(
            self._read_loop(), name=f"p2p-read-{self.peer}"
        )
        self._reading = reading
        try:
            await asyncio.wait({reading})
        finally:
            reading.cancel()
            await asyncio.wait({reading})
            error = None if reading.cancelled() else reading.exception()
            self.abort(describe_error(error) if error is not None else "closing")
            self.channel.close()
        return error

    async def _read_loop(self) -> None:
        node = self.node
        channel = self.channel
        loop = asyncio.get_running_loop()
        header = memoryview(bytearray(FRAME.size))
        meta = memoryview(bytearray(CHUNK_META.size + HEADER_BYTES))
        while True:
            await channel.recv_exactly(header)  # an idle link may wait here forever
            self.last_rx = loop.time()
            kind, length = parse_frame_header(header, node.max_frame_bytes)
            with anyio.fail_after(node.io_timeout_s):
                if kind is Kind.CHUNK:
                    await self._receive_chunk(length, meta)
                elif kind is Kind.MISSING:
                    await self._receive_missing(length, meta)
                elif kind is Kind.ANNOUNCE or kind is Kind.WITHDRAW:
                    body = bytearray(length)
                    await channel.recv_exactly(memoryview(body))
                    keys = decode_key_list(body)
                    if kind is Kind.ANNOUNCE:
                        node.index.add(self, keys)
                        change = Change.ANNOUNCE
                    else:
                        node.index.remove(self, keys)
                        change = Change.WITHDRAW
                    node.index_changed()
                    node.metrics.index_traffic(
                        Flow.RECEIVED, change, len(keys), FRAME.size + length
                    )
                else:
                    raise ProtocolError(f"unexpected {kind.name} frame from an owner")
            self.last_rx = loop.time()

    def _request_for(self, meta: memoryview) -> tuple[Request, int]:
        request_id, position = CHUNK_META.unpack_from(meta)
        request = self._requests.get(request_id)
        if request is None or not request.pending(position):
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
        node = self.node
        problem = node.chunk_format.verify(meta[CHUNK_META.size :], key, slot)
        if problem is None:
            if node.index.recovered(self, key):
                node.metrics.count(CORRUPT_RECOVERIES)
            request.resolve(position, None)
            return
        node.integrity_failure(self.peer, problem)
        request.resolve(position, f"corrupt chunk: {problem}")
        # Damaged on the way or in the owner's memory: the owner can tell which. Until
        # it withdraws the key, this copy is skipped for a while, then asked for again.
        wait = node.index.back_off(self, key)
        node.metrics.count(CORRUPT_BACKOFFS)
        logger.debug(
            "tier %s: not asking peer %s for a key for %.3g s after a corrupt chunk",
            node.tier_name,
            self.peer,
            wait,
        )
        if self.version >= CORRUPT_SINCE_VERSION:
            await self._report_corrupt([key])

    async def _report_corrupt(self, keys: list[OffloadKey]) -> None:
        """Tell the owner ``keys`` came in failing verification. Called by the reading
        task: an error ends the link, as any other on it."""
        async with self._send_lock:
            await send_frame(self.channel, Kind.CORRUPT, encode_key_list(keys))
        self.node.metrics.corrupt_reported(Flow.SENT, len(keys))

    async def _receive_missing(self, length: int, meta: memoryview) -> None:
        if length != CHUNK_META.size:
            raise ProtocolError("malformed missing-chunk frame")
        await self.channel.recv_exactly(meta[: CHUNK_META.size])
        request, position = self._request_for(meta)
        key = request.keys[position]
        request.resolve(position, "the peer no longer holds it")
        self.node.index.remove(self, [key])
        self.node.index_changed()


async def fetch_chunks(
    index: PeerIndex[Link],
    keys: Sequence[OffloadKey],
    views: Sequence[memoryview],
    io_timeout_s: float,
) -> list[str | None]:
    """Pull each key's chunk into its view from a live peer that announced it.

    Returns, per key, None (loaded and verified) or why not. A link that sends nothing
    for ``io_timeout_s`` is aborted; when this returns or is cancelled, no link writes
    into ``views`` any more.
    """
    outcomes: list[str | None] = [NO_HOLDER] * len(keys)
    plan: dict[Link, list[int]] = {}
    for position, key in enumerate(keys):
        link = index.pick(key)
        if link is not None:
            plan.setdefault(link, []).append(position)
    requests: list[tuple[Request, list[int]]] = []
    try:
        for link, positions in plan.items():
            for part in fetch_batches(keys, positions):
                sent = await link.fetch([keys[p] for p in part], [views[p] for p in part])
                requests.append((sent, part))
        await _await_requests([request for request, _ in requests], io_timeout_s)
    finally:
        for request, _ in requests:
            if not request.finished.done():
                # The reader may be receiving into one of these slots: stop it before
                # the framework hands the slots to anyone else.
                request.link.abort("a load stopped waiting for its chunks")
    for request, part in requests:
        for position, result in zip(part, request.results, strict=True):
            outcomes[position] = result
    return outcomes


async def _await_requests(requests: list[Request], io_timeout_s: float) -> None:
    """Wait for every request; a link that sends nothing for io_timeout_s is aborted."""
    loop = asyncio.get_running_loop()
    check_every = min(1.0, io_timeout_s / 4)
    pending = {request.finished for request in requests if not request.finished.done()}
    while pending:
        _, pending = await asyncio.wait(pending, timeout=check_every)
        now = loop.time()
        for request in requests:
            if request.finished.done():
                continue
            quiet = now - max(request.link.last_rx, request.sent_at)
            if quiet > io_timeout_s:
                request.link.abort(f"no data for {io_timeout_s:g} s")


class Dialer:
    """Keeps this node reading from one peer: dial, authenticate, run the link, redial."""

    def __init__(
        self,
        node: Node,
        transport: Transport,
        address: tuple[str, int],
        *,
        reconnect_initial_s: float,
        reconnect_max_s: float,
    ) -> None:
        self.node = node
        self.address = address
        #: The peer as ``peers`` lists it.
        self.peer = format_address(address)
        #: The link while one is up.
        self.link: Link | None = None
        #: The protocol version the next dial proposes: lower after the peer refused
        #: a higher one, back to this node's own once a link ends.
        self.version = PROTOCOL_VERSION
        self._transport = transport
        self._reconnect_initial_s = reconnect_initial_s
        self._reconnect_max_s = reconnect_max_s

    @property
    def connected(self) -> bool:
        return self.link is not None and self.link.live

    async def run(self) -> None:
        """Dial until cancelled; returns only when the peer turns out to be this node."""
        node = self.node
        failures = 0
        while True:
            try:
                link = await self._connect()
            except (SelfConnection, Rejected) as exc:
                if self._older_version(exc):
                    continue
                if isinstance(exc, Rejected) and exc.reason is not Reject.SELF:
                    node.metrics.count(AUTH_FAILURES)
                    failures += 1
                    self._failed(failures, exc)
                else:
                    logger.info("tier %s: peer %s is this node itself", node.tier_name, self.peer)
                    return
            except (AuthError, ssl.SSLError) as exc:
                node.metrics.count(AUTH_FAILURES)
                failures += 1
                self._failed(failures, exc)
            except (OSError, LinkError) as exc:
                failures += 1
                self._failed(failures, exc)
            else:
                if failures:
                    logger.info(
                        "tier %s: peer %s reachable again after %d failed attempt(s)",
                        node.tier_name,
                        self.peer,
                        failures,
                    )
                failures = 0
                await self._keep(link)
            await asyncio.sleep(self._backoff(failures))

    def _older_version(self, exc: BaseException) -> bool:
        """Whether the owner refused the version proposed and a lower one is left to
        try (at once: it is no failure but an owner not yet upgraded)."""
        if not isinstance(exc, Rejected) or exc.reason is not Reject.VERSION:
            return False
        if self.version <= MIN_PROTOCOL_VERSION:
            return False
        self.version -= 1
        logger.info(
            "tier %s: peer %s refused protocol version %d; dialing again with %d",
            self.node.tier_name,
            self.peer,
            self.version + 1,
            self.version,
        )
        return True

    async def _connect(self) -> Link:
        host, port = self.address
        with anyio.fail_after(self.node.connect_timeout_s):
            opened = await self._transport.connect(host, port)
            try:
                channel, remote = await self.node.credentials.as_reader(opened, host, self.version)
            except BaseException:
                opened.close()
                raise
        return Link(self.node, self.peer, channel, remote)

    async def _keep(self, link: Link) -> None:
        """Run ``link`` until it ends, then forget what its owner announced."""
        node = self.node
        self.link = link
        node.metrics.connection_opened(Direction.OUTBOUND)
        logger.info(
            "tier %s: reading from peer %s (node %s, protocol %d)",
            node.tier_name,
            self.peer,
            link.remote_id.hex(),
            link.version,
        )
        try:
            error = await link.run()
        finally:
            self.link = None
            # The owner may come back upgraded.
            self.version = PROTOCOL_VERSION
            node.metrics.connection_closed(Direction.OUTBOUND)
        # Not reached when the tier closes (cancelled): nothing to report or clean then.
        if isinstance(error, ProtocolError):
            node.metrics.count(FRAMES_REJECTED)
        reason = describe_error(error) if error is not None else link.end_reason or "closing"
        quiet = isinstance(error, PeerClosed)
        (logger.info if quiet else logger.warning)(
            "tier %s: lost peer %s: %s", node.tier_name, self.peer, reason
        )
        await node.index.drop(link)
        node.index_changed()

    def _backoff(self, failures: int) -> float:
        step = min(self._reconnect_max_s, self._reconnect_initial_s * 2.0 ** max(0, failures - 1))
        return step * random.uniform(0.5, 1.0)

    def _failed(self, failures: int, exc: BaseException) -> None:
        # The first failure of a run is worth a warning; the retries that follow are not.
        log = logger.warning if failures == 1 else logger.debug
        log(
            "tier %s: cannot read from peer %s (attempt %d): %s",
            self.node.tier_name,
            self.peer,
            failures,
            describe_error(exc),
        )
