"""What a node's connections share: the :class:`Node` context and its metrics.

Links (:mod:`~kvtier.tiers.p2p.reader`) and sessions (:mod:`~kvtier.tiers.p2p.owner`)
take a :class:`Node`, never the tier: it holds exactly what they use (the index, the
announcer, the chunk format, the timeouts and frame limit, the counters, pinned reads
of the primary tier) and nothing they could reach around.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from kvtier.format import ChunkFormat
from kvtier.keys import OffloadKey
from kvtier.resources import TaskSet
from kvtier.tiers.base import PrimaryAccess, TierContext
from kvtier.tiers.kit import ThrottledLog
from kvtier.tiers.p2p.handshake import Credentials
from kvtier.tiers.p2p.index import Announcer, PeerIndex

__all__ = [
    "ANNOUNCE_BYTES",
    "ANNOUNCE_FRAMES",
    "ANNOUNCE_KEYS",
    "AUTH_FAILURES",
    "CONNECTIONS",
    "CORRUPT_BACKOFFS",
    "CORRUPT_RECOVERIES",
    "CORRUPT_REPORTS",
    "FRAMES_REJECTED",
    "INDEXED_KEYS",
    "INDEX_MEMORY",
    "REVERIFIED_CHUNKS",
    "SERVED_CHUNKS",
    "Change",
    "Direction",
    "Flow",
    "Node",
    "NodeMetrics",
    "Verdict",
]

CONNECTIONS = "kvtier_p2p_connections"
AUTH_FAILURES = "kvtier_p2p_auth_failures"
FRAMES_REJECTED = "kvtier_p2p_frames_rejected"
INDEXED_KEYS = "kvtier_p2p_indexed_keys"
SERVED_CHUNKS = "kvtier_p2p_served_chunks"
ANNOUNCE_FRAMES = "kvtier_p2p_announce_frames"
ANNOUNCE_KEYS = "kvtier_p2p_announce_keys"
ANNOUNCE_BYTES = "kvtier_p2p_announce_bytes"
INDEX_MEMORY = "kvtier_p2p_index_memory_bytes"
CORRUPT_REPORTS = "kvtier_p2p_corrupt_reports"
REVERIFIED_CHUNKS = "kvtier_p2p_reverified_chunks"
CORRUPT_BACKOFFS = "kvtier_p2p_corrupt_backoffs"
CORRUPT_RECOVERIES = "kvtier_p2p_corrupt_recoveries"


class Direction(enum.Enum):
    """Which way a connection serves (the ``direction`` label of CONNECTIONS)."""

    #: A peer reads from this node.
    INBOUND = "inbound"
    #: This node reads from a peer.
    OUTBOUND = "outbound"


class Flow(enum.Enum):
    """Which way index traffic went (the ``flow`` label of the ANNOUNCE_* counters)."""

    #: This node told its readers.
    SENT = "sent"
    #: A peer told this node.
    RECEIVED = "received"


class Change(enum.Enum):
    """What an index frame says (the ``change`` label of the ANNOUNCE_* counters)."""

    #: ANNOUNCE: the owner now holds the keys.
    ANNOUNCE = "announce"
    #: WITHDRAW: the owner no longer holds them.
    WITHDRAW = "withdraw"


class Verdict(enum.Enum):
    """What an owner found re-checking a row a reader reported corrupt (the ``verdict``
    label of REVERIFIED_CHUNKS)."""

    #: The row still matches its checksum from store time: the key stays announced.
    INTACT = "intact"
    #: The row changed since: the key is withdrawn.
    DAMAGED = "damaged"


class NodeMetrics:
    """The p2p metrics of one tier, labelled with its name."""

    def __init__(self, ctx: TierContext) -> None:
        self._recorder = ctx.metrics
        self._tier = ctx.tier_name
        self._connections = dict.fromkeys(Direction, 0)

    def count(self, name: str, amount: int = 1) -> None:
        """Add to the counter ``name`` (AUTH_FAILURES, FRAMES_REJECTED, SERVED_CHUNKS,
        CORRUPT_BACKOFFS, CORRUPT_RECOVERIES)."""
        self._recorder.inc(name, amount, (self._tier,))

    def corrupt_reported(self, flow: Flow, keys: int) -> None:
        """A CORRUPT frame of ``keys`` keys went ``flow``."""
        self._recorder.inc(CORRUPT_REPORTS, keys, (self._tier, flow.value))

    def reverified(self, verdict: Verdict, keys: int) -> None:
        if keys:
            self._recorder.inc(REVERIFIED_CHUNKS, keys, (self._tier, verdict.value))

    def connection_opened(self, direction: Direction) -> None:
        self._set_connections(direction, +1)

    def connection_closed(self, direction: Direction) -> None:
        self._set_connections(direction, -1)

    def indexed(self, keys: int, memory_bytes: int) -> None:
        self._recorder.set(INDEXED_KEYS, keys, (self._tier,))
        self._recorder.set(INDEX_MEMORY, memory_bytes, (self._tier,))

    def index_traffic(self, flow: Flow, change: Change, keys: int, wire_bytes: int) -> None:
        """One ANNOUNCE or WITHDRAW frame of ``keys`` keys, ``wire_bytes`` long with its
        header, went ``flow``."""
        labels = (self._tier, flow.value, change.value)
        self._recorder.inc(ANNOUNCE_FRAMES, 1, labels)
        self._recorder.inc(ANNOUNCE_KEYS, keys, labels)
        self._recorder.inc(ANNOUNCE_BYTES, wire_bytes, labels)

    def _set_connections(self, direction: Direction, change: int) -> None:
        self._connections[direction] += change
        count = self._connections[direction]
        self._recorder.set(CONNECTIONS, count, (self._tier, direction.value))


@dataclass(frozen=True)
class Node:
    """One node's shared state, as its links and sessions see it.

    Built when the tier starts (the secret and the TLS contexts are read then).
    """

    tier_name: str
    credentials: Credentials
    chunk_format: ChunkFormat
    #: Keys peers announced, by the link that heard them.
    index: PeerIndex[Any]
    #: Keys this node announces to its readers.
    announcer: Announcer
    metrics: NodeMetrics
    #: Recurring problems (bad handshakes, refused connections), logged once a while.
    log: ThrottledLog
    #: The tier's tasks: connections served, pins waiting on the manager.
    tasks: TaskSet
    #: Pinned reads of this node's primary tier; None answers every fetch "missing".
    primary: PrimaryAccess | None
    #: Stop announcing keys whose rows changed since they were stored (as an eviction
    #: does: the announcer tells every reader, the tier's event log records it).
    withdraw: Callable[[Sequence[OffloadKey]], None]
    #: The framework's count of chunks that failed verification
    #: (``TierContext.report_integrity_failure``).
    report_integrity_failure: Callable[[int], None]
    connect_timeout_s: float
    io_timeout_s: float
    #: The longest frame accepted after the handshake.
    max_frame_bytes: int

    def index_changed(self) -> None:
        self.metrics.indexed(len(self.index), self.index.memory_bytes())

    def integrity_failure(self, peer: str, problem: str) -> None:
        """A chunk from ``peer`` failed verification: counted and logged, never served."""
        self.report_integrity_failure(1)
        self.log.warning(
            "integrity", "a chunk from peer %s failed verification (%s); not served", peer, problem
        )

    async def pin(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, memoryview]:
        """Pin ``keys`` in this node's primary tier; the caller unpins what it got.

        The pin runs as a task of its own and is only shielded from here: if this
        coroutine is cancelled or times out just as the manager answers, the rows it
        would have lost are unpinned when the answer lands.
        """
        primary = self.primary
        if primary is None:
            return {}
        task = self.tasks.spawn(primary.pin(keys), name="p2p-pin")
        try:
            with anyio.fail_after(self.io_timeout_s):
                return await asyncio.shield(task)
        except BaseException:
            task.add_done_callback(lambda done: _unpin_result(primary, done))
            raise

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        if keys and self.primary is not None:
            self.primary.unpin(keys)


def _unpin_result(primary: PrimaryAccess, task: asyncio.Task[dict[OffloadKey, memoryview]]) -> None:
    if not task.cancelled() and task.exception() is None:
        primary.unpin(list(task.result()))
