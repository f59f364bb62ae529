"""The peer-to-peer tier: kvtier nodes serve each other's primary tiers over TCP.

The tier keeps no bytes of its own. A cascade (``store``) only *announces* to the
connected peers that this node now holds the keys in its primary tier; an eviction
(``on_primary_removed``) withdraws them. Each node keeps an index of what every peer
announced, so ``contains`` and ``lookup`` are dictionary probes. A promotion (``load``)
asks a peer that announced the key for it; the peer pins the chunk in its primary tier
while it sends a :class:`~kvtier.format.ChunkFormat` header (with the checksum
taken when the chunk was stored) and the row, which the requester receives straight
into the destination primary slot and verifies before it reports the key loaded.

A chunk that fails that verification is a counted miss, never served, but the key is
not dropped: a bit flipped on the way says nothing about the owner's copy. The reader
skips that peer's copy of the key for ``retry_corrupt_after_s``, doubling with each
further failure up to ``retry_corrupt_max_s``, and back to none after a good transfer,
so a transient fault heals by itself and a link that corrupts everything is asked
seldom. It also tells the owner (a CORRUPT frame, protocol version 2): the owner checks
its own row against the checksum taken when it was stored and withdraws the key from
every reader only if its own copy changed (``kvtier_p2p_reverified_chunks``).

Connections (see :mod:`~kvtier.tiers.p2p.wire` for the wire format). Each node listens
on ``listen`` and dials every entry of ``peers``. A connection has one purpose, set by
who dialed it: the dialing node *reads* (it receives the other's announcements and
pulls chunks), the accepting node *owns* (it announces and serves). Two nodes that list
each other hold two connections, one per direction. This was chosen over one shared
connection per pair because:

- nothing can race: two nodes dialing each other at once is the normal case, not a
  duplicate to detect and tear down by a tie-break rule;
- an accepted connection, the one a stranger can open, parses only FETCH requests and
  never writes into a primary slot: the receive path into the region exists only on
  connections this node chose to dial;
- ``peers`` reads as "the nodes whose primary tiers I read", so one-way topologies
  (a node that only serves, a node that only reads) need no extra setting;
- reconnecting and resynchronising live only in the dialer: every new connection
  starts with the owner's full key set, then its changes in order.

Every connection authenticates first (:mod:`~kvtier.tiers.p2p.handshake`: an
HMAC-SHA256 challenge-response over the shared secret, in both directions), optionally
inside mutual TLS. A frame the state does not allow, a malformed or oversized one, a
failed proof or a namespace mismatch closes that connection only.

The modules, bottom-up (each imports only those above it in this list):

=============  =====================================================================
``errors``     why a connection ends
``channel``    Channel / Listener / Transport interfaces; TLS over any channel
``sockets``    the default transport: TCP sockets
``memory``     an in-memory transport for tests
``wire``       frames, key lists, fetch requests
``handshake``  the secret proof, HELLO, :class:`Credentials` (TLS + authentication)
``index``      the peer index, the announcer and its outboxes
``context``    :class:`Node`: what links and sessions share, and the metrics
``reader``     links this node dials, the dial loop, fetching chunks
``owner``      sessions peers dial, the accept loop, serving chunks
``settings``   :class:`PeerSettings`, the tier's parameters
``tier``       :class:`PeerTier`
=============  =====================================================================

Timeouts use ``anyio.fail_after``, a cancel scope on the running task: asyncio has no
such scope before Python 3.11, and ``asyncio.wait_for`` before 3.12 runs the awaited
read in a task of its own, which would outlive an abort (see ``reader.Link``).
"""

from kvtier.tiers.p2p.channel import Channel, Listener, Transport
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
)
from kvtier.tiers.p2p.memory import MemoryTransport
from kvtier.tiers.p2p.settings import PeerSettings
from kvtier.tiers.p2p.sockets import SocketTransport
from kvtier.tiers.p2p.tier import PeerTier

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
    "Channel",
    "Listener",
    "MemoryTransport",
    "PeerSettings",
    "PeerTier",
    "SocketTransport",
    "Transport",
]
