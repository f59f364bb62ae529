"""The p2p wire format: frames, key lists and fetch requests.

Every frame is a 12-byte header followed by its body::

    kind (1 byte) | three zero bytes | body length (8 bytes, big-endian) | body

A receiver checks the header before it reads a byte of the body: an unknown kind, a
non-zero pad byte, a kind the connection's state does not allow, or a length above the
connection's limit ends that connection (:class:`ProtocolError`), never the process.

Connections are one-way in purpose. The node that dials (the *reader*) authenticates
(:mod:`kvtier.tiers.p2p.handshake`), then only sends ``FETCH`` (and, from protocol
version 2, ``CORRUPT``); the node that accepts (the *owner*) sends the keys it holds
(``ANNOUNCE`` / ``WITHDRAW``) and answers each ``FETCH`` with one ``CHUNK`` or
``MISSING`` per key. So an accepted connection, the one anybody can open, never writes
into a primary slot. Bodies:

=========  =========================================================================
HELLO      see :mod:`kvtier.tiers.p2p.handshake`
PROOF      HMAC-SHA256 (32 bytes), see :func:`kvtier.tiers.p2p.handshake.proof`
REJECT     one reason byte (:class:`~kvtier.tiers.p2p.errors.Reject`), then the
           connection closes
ANNOUNCE   key list: keys the owner now holds in its primary tier
WITHDRAW   key list: keys the owner no longer holds
FETCH      request id (4), key list
CHUNK      request id (4), position in the request (4), chunk header
           (:mod:`kvtier.format`, 4096 bytes), the chunk's whole primary row
MISSING    request id (4), position (4): the owner does not hold that key any more
CORRUPT    key list: keys whose chunks reached the reader failing verification; the
           owner checks its own rows against their checksums and withdraws those
           that changed (version 2 on; a version-1 connection never carries it)
=========  =========================================================================

A key list is a 4-byte count, then each key as a 2-byte length and its bytes.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator, Sequence

from kvtier.format import HEADER_BYTES, MAX_KEY_BYTES
from kvtier.keys import OffloadKey
from kvtier.tiers.p2p.channel import Buffer, Channel
from kvtier.tiers.p2p.errors import ProtocolError

__all__ = [
    "CHUNK_META",
    "CONTROL_BATCH_BYTES",
    "CORRUPT_SINCE_VERSION",
    "FRAME",
    "MAX_FETCH_KEYS",
    "Kind",
    "chunk_body_bytes",
    "decode_fetch",
    "decode_key_list",
    "encode_fetch",
    "encode_key_list",
    "fetch_batches",
    "key_batches",
    "parse_frame_header",
    "read_frame",
    "send_frame",
]

FRAME = struct.Struct(">B3xQ")
#: Request id and position, the start of a CHUNK or MISSING body.
CHUNK_META = struct.Struct(">II")
_COUNT = struct.Struct(">I")
_KEY_LENGTH = struct.Struct(">H")
_REQUEST_ID = struct.Struct(">I")

# Announcements and fetch requests are cut into frames of at most this many bytes
# (about 800 keys of 36 bytes), well within any peer's frame limit (>= 64 KiB).
CONTROL_BATCH_BYTES = 32 * 1024
#: The most keys one FETCH may ask for (or one CORRUPT report); an owner refuses more.
MAX_FETCH_KEYS = 1024
#: The first protocol version (:mod:`~kvtier.tiers.p2p.handshake`) whose connections
#: carry CORRUPT frames.
CORRUPT_SINCE_VERSION = 2


class Kind(enum.IntEnum):
    """Frame kinds."""

    HELLO = 1
    PROOF = 2
    REJECT = 3
    ANNOUNCE = 16
    WITHDRAW = 17
    FETCH = 32
    CHUNK = 33
    MISSING = 34
    CORRUPT = 35


def parse_frame_header(header: Buffer, max_body: int | None = None) -> tuple[Kind, int]:
    """The kind and body length of a frame header.

    Raises:
        ProtocolError: a pad byte is not zero, the kind is unknown, or the body is
            longer than ``max_body``.
    """
    raw_kind, length = FRAME.unpack(header)
    if bytes(header[1:4]) != b"\0\0\0":
        raise ProtocolError("malformed frame header")
    try:
        kind = Kind(raw_kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {raw_kind}") from None
    if max_body is not None and length > max_body:
        raise ProtocolError(f"a {kind.name} frame of {length} bytes, at most {max_body} allowed")
    return kind, length


async def send_frame(channel: Channel, kind: Kind, body: bytes = b"") -> None:
    await channel.send(FRAME.pack(kind, len(body)) + body)


async def read_frame(channel: Channel, max_body: int) -> tuple[Kind, bytearray]:
    """One whole frame whose body is at most ``max_body`` bytes.

    The limit is checked before a buffer is allocated for the body.

    Raises:
        ProtocolError: a malformed header or a longer body.
        PeerClosed: the stream ended.
    """
    header = bytearray(FRAME.size)
    await channel.recv_exactly(memoryview(header))
    kind, length = parse_frame_header(header, max_body)
    body = bytearray(length)
    if length:
        await channel.recv_exactly(memoryview(body))
    return kind, body


def chunk_body_bytes(chunk_bytes: int) -> int:
    """Length of the body of a CHUNK frame carrying a row of ``chunk_bytes``."""
    return CHUNK_META.size + HEADER_BYTES + chunk_bytes


# ---------------------------------------------------------------- key lists


def encode_key_list(keys: Sequence[bytes]) -> bytes:
    parts = [_COUNT.pack(len(keys))]
    for key in keys:
        parts.append(_KEY_LENGTH.pack(len(key)))
        parts.append(key)
    return b"".join(parts)


def decode_key_list(body: Buffer, offset: int = 0, max_keys: int | None = None) -> list[OffloadKey]:
    """The keys of a key list that fills ``body`` from ``offset`` to its end.

    Raises:
        ProtocolError: the list is truncated, has bytes after it, holds an empty key or
            one longer than a chunk header can name, or more than ``max_keys`` keys.
    """
    view = memoryview(body)
    end = len(view)
    if end - offset < _COUNT.size:
        raise ProtocolError("truncated key list")
    (count,) = _COUNT.unpack_from(view, offset)
    offset += _COUNT.size
    if max_keys is not None and count > max_keys:
        raise ProtocolError(f"a key list of {count} keys, at most {max_keys} allowed")
    # Every key takes at least 3 bytes: a count that cannot fit is refused up front.
    if count * (_KEY_LENGTH.size + 1) > end - offset:
        raise ProtocolError("truncated key list")
    keys: list[OffloadKey] = []
    for _ in range(count):
        if end - offset < _KEY_LENGTH.size:
            raise ProtocolError("truncated key list")
        (length,) = _KEY_LENGTH.unpack_from(view, offset)
        offset += _KEY_LENGTH.size
        if not 0 < length <= MAX_KEY_BYTES or end - offset < length:
            raise ProtocolError("malformed key in a key list")
        keys.append(OffloadKey(bytes(view[offset : offset + length])))
        offset += length
    if offset != end:
        raise ProtocolError("bytes after a key list")
    return keys


def key_batches(keys: Sequence[OffloadKey], max_bytes: int) -> Iterator[list[OffloadKey]]:
    """``keys`` cut into runs whose encoded key list stays within ``max_bytes``."""
    batch: list[OffloadKey] = []
    size = _COUNT.size
    for key in keys:
        cost = _KEY_LENGTH.size + len(key)
        if batch and size + cost > max_bytes:
            yield batch
            batch, size = [], _COUNT.size
        batch.append(key)
        size += cost
    if batch:
        yield batch


# ------------------------------------------------------------ fetch requests


def encode_fetch(request_id: int, keys: Sequence[bytes]) -> bytes:
    return _REQUEST_ID.pack(request_id) + encode_key_list(keys)


def decode_fetch(body: Buffer, max_keys: int = MAX_FETCH_KEYS) -> tuple[int, list[OffloadKey]]:
    """The request id and keys of a FETCH body.

    Raises:
        ProtocolError: a malformed key list, more than ``max_keys`` keys, or none.
    """
    if len(body) < _REQUEST_ID.size:
        raise ProtocolError("truncated fetch request")
    (request_id,) = _REQUEST_ID.unpack_from(body, 0)
    keys = decode_key_list(body, _REQUEST_ID.size, max_keys)
    if not keys:
        raise ProtocolError("a fetch request for no keys")
    return request_id, keys


def fetch_batches(keys: Sequence[OffloadKey], positions: Sequence[int]) -> list[list[int]]:
    """``positions`` (into ``keys``) cut so each FETCH stays within MAX_FETCH_KEYS and
    CONTROL_BATCH_BYTES."""
    limit = CONTROL_BATCH_BYTES - _REQUEST_ID.size - _COUNT.size
    batches: list[list[int]] = []
    batch: list[int] = []
    size = 0
    for position in positions:
        cost = _KEY_LENGTH.size + len(keys[position])
        if batch and (len(batch) == MAX_FETCH_KEYS or size + cost > limit):
            batches.append(batch)
            batch, size = [], 0
        batch.append(position)
        size += cost
    if batch:
        batches.append(batch)
    return batches
