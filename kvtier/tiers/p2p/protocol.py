"""The p2p tier's wire protocol: frames, the shared-secret handshake, byte channels.

Every frame is a 12-byte header followed by its body::

    kind (1 byte) | three zero bytes | body length (8 bytes, big-endian) | body

A receiver checks the header before it reads a byte of the body: an unknown kind, a
non-zero pad byte, a kind the connection's state does not allow, or a length above the
connection's limit ends that connection (:class:`ProtocolError`), never the process.

Connections are one-way in purpose. The node that dials (the *reader*) authenticates,
then only sends ``FETCH``; the node that accepts (the *owner*) sends the keys it holds
(``ANNOUNCE`` / ``WITHDRAW``) and answers each ``FETCH`` with one ``CHUNK`` or
``MISSING`` per key. So an accepted connection, the one anybody can open, never writes
into a primary slot. Bodies:

=========  =========================================================================
HELLO      magic, version, node id (16), nonce (32), namespace digest (16; zeros from
           the owner, which reveals nothing before the reader proved the secret)
PROOF      HMAC-SHA256 (32 bytes), see :meth:`Secret.proof`
REJECT     one reason byte (:class:`Reject`), then the connection closes
ANNOUNCE   key list: keys the owner now holds in its primary tier
WITHDRAW   key list: keys the owner no longer holds
FETCH      request id (4), key list
CHUNK      request id (4), position in the request (4), chunk header
           (:mod:`kvtier.tiers._format`, 4096 bytes), the chunk's whole primary row
MISSING    request id (4), position (4): the owner does not hold that key any more
=========  =========================================================================

A key list is a 4-byte count, then each key as a 2-byte length and its bytes.

The handshake, before which only HELLO, PROOF and REJECT frames of at most
:data:`PREAUTH_MAX_BODY` bytes are accepted:

1. reader -> owner: HELLO with its namespace digest. The owner refuses (REJECT) another
   protocol version, another namespace, or its own node id (a node dialing itself).
2. owner -> reader: HELLO.
3. reader -> owner: PROOF("reader"); the owner checks it with ``hmac.compare_digest``
   and REJECTs a wrong one.
4. owner -> reader: PROOF("owner"); the reader checks it and hangs up on a wrong one.

Each proof is keyed by the secret and covers a fixed context string, the prover's role,
both nonces, both node ids and the namespace digest, so a proof cannot be replayed on
another connection, reflected back to its sender, or reused across namespaces.

Channels move bytes between a socket and caller-owned buffers with no copy of their
own: :class:`PlainChannel` calls ``loop.sock_recv_into`` / ``loop.sock_sendall`` on the
socket (both hand the kernel the caller's memoryview), :class:`TlsChannel` decrypts
straight into the caller's buffer with ``SSLObject.read(n, buffer)``. asyncio streams
copy every read into a new ``bytes``; they measured 38 % of raw loopback TCP here, the
socket calls ~100 % (DESIGN section 11).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import hmac
import socket
import ssl
import struct
from collections.abc import Iterator, Sequence
from typing import cast

from kvtier.keys import OffloadKey
from kvtier.tiers._format import HEADER_BYTES, MAX_KEY_BYTES

__all__ = [
    "CHUNK_META",
    "FRAME",
    "HELLO",
    "PREAUTH_MAX_BODY",
    "PROTOCOL_VERSION",
    "AuthError",
    "Channel",
    "Hello",
    "Kind",
    "LinkError",
    "PeerClosed",
    "PlainChannel",
    "ProtocolError",
    "Reject",
    "Rejected",
    "Role",
    "Secret",
    "SelfConnection",
    "TlsChannel",
    "authenticate_owner",
    "authenticate_reader",
    "chunk_body_bytes",
    "decode_fetch",
    "decode_hello",
    "decode_key_list",
    "encode_fetch",
    "encode_hello",
    "encode_key_list",
    "key_batches",
    "pack_frame_header",
    "parse_frame_header",
    "read_frame",
    "send_frame",
    "tune_socket",
]

PROTOCOL_VERSION = 1
_MAGIC = b"KVTP2P\r\n"
_CONTEXT = b"kvtier p2p handshake v1\0"

FRAME = struct.Struct(">B3xQ")
HELLO = struct.Struct(">8sH16s32s16s")
CHUNK_META = struct.Struct(">II")
_COUNT = struct.Struct(">I")
_KEY_LENGTH = struct.Struct(">H")
_REQUEST_ID = struct.Struct(">I")

NODE_ID_BYTES = 16
NONCE_BYTES = 32
DIGEST_BYTES = 16
PROOF_BYTES = hashlib.sha256().digest_size
#: No frame before authentication is longer than a HELLO; anything bigger is an attack
#: or another protocol, and is refused before a buffer is allocated for it.
PREAUTH_MAX_BODY = 256

# Ciphertext is read from the socket in pieces of this size: a 256 KiB read drains a
# loopback socket buffer in one call while keeping the decrypt of one piece (~0.1 ms
# with AES-NI) short enough not to stall the event loop.
_TLS_READ_BYTES = 256 * 1024
# Plaintext is encrypted and sent in pieces of this size for the same reason.
_TLS_WRITE_BYTES = 256 * 1024

# TCP keepalive: a peer host that vanishes without a FIN or RST (power loss, a network
# partition) is noticed on an idle connection after about 10 + 3 * 5 = 25 s. Busy
# connections notice sooner through io_timeout_s.
_KEEPALIVE_IDLE_S = 10
_KEEPALIVE_INTERVAL_S = 5
_KEEPALIVE_COUNT = 3


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


class Role(enum.Enum):
    """Which end of a connection a node is."""

    #: Dialed the connection; reads the owner's index and pulls chunks.
    READER = b"reader"
    #: Accepted the connection; announces its keys and serves chunks.
    OWNER = b"owner"


class Reject(enum.IntEnum):
    """Why an owner refused a connection (the byte of a REJECT frame)."""

    VERSION = 1
    NAMESPACE = 2
    AUTHENTICATION = 3
    SELF = 4

    @property
    def reason(self) -> str:
        return _REJECT_REASONS[self]


_REJECT_CODES = frozenset(int(member) for member in Reject)
_REJECT_REASONS = {
    Reject.VERSION: "another protocol version",
    Reject.NAMESPACE: "another namespace (model, dtype or chunk geometry differ)",
    Reject.AUTHENTICATION: "authentication failed (wrong secret?)",
    Reject.SELF: "the address is this node itself",
}


class LinkError(Exception):
    """A connection cannot go on; the message says why (never a secret)."""


class ProtocolError(LinkError):
    """The peer sent a frame this protocol does not allow."""


class PeerClosed(LinkError):
    """The peer closed the connection."""


class AuthError(LinkError):
    """The handshake failed: wrong secret, namespace or version, or a bad frame."""


class Rejected(AuthError):
    """The owner refused the handshake with a REJECT frame."""

    def __init__(self, reason: Reject) -> None:
        super().__init__(f"the peer refused the connection: {reason.reason}")
        self.reason = reason


class SelfConnection(AuthError):
    """Both ends of the connection are the same node."""


class Secret:
    """The shared secret. Its bytes never appear in a repr, a message or a log line."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        self._key = key

    def __repr__(self) -> str:
        return "Secret(<hidden>)"

    __str__ = __repr__

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("the p2p secret cannot be pickled")

    def proof(
        self,
        role: Role,
        *,
        prover_id: bytes,
        prover_nonce: bytes,
        challenger_id: bytes,
        challenger_nonce: bytes,
        digest: bytes,
    ) -> bytes:
        """HMAC-SHA256 by which ``role`` proves it knows the secret.

        The role keeps a proof from being reflected back to the node that issued the
        challenge, the nonces from being replayed on another connection, the namespace
        digest from being reused by a node of another model.
        """
        message = b"".join(
            (
                _CONTEXT,
                role.value,
                b"\0",
                challenger_nonce,
                prover_nonce,
                challenger_id,
                prover_id,
                digest,
            )
        )
        return hmac.new(self._key, message, hashlib.sha256).digest()


# ------------------------------------------------------------------ framing


def pack_frame_header(kind: Kind, length: int) -> bytes:
    return FRAME.pack(kind, length)


def parse_frame_header(header: bytes | bytearray | memoryview) -> tuple[Kind, int]:
    """The kind and body length of a frame header.

    Raises:
        ProtocolError: a pad byte is not zero or the kind is unknown.
    """
    raw_kind, length = FRAME.unpack(header)
    if bytes(header[1:4]) != b"\0\0\0":
        raise ProtocolError("malformed frame header")
    try:
        kind = Kind(raw_kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {raw_kind}") from None
    return kind, length


def chunk_body_bytes(chunk_bytes: int) -> int:
    """Length of the body of a CHUNK frame carrying a row of ``chunk_bytes``."""
    return CHUNK_META.size + HEADER_BYTES + chunk_bytes


def encode_key_list(keys: Sequence[bytes]) -> bytes:
    parts = [_COUNT.pack(len(keys))]
    for key in keys:
        parts.append(_KEY_LENGTH.pack(len(key)))
        parts.append(key)
    return b"".join(parts)


def decode_key_list(
    body: bytes | bytearray | memoryview, offset: int = 0, max_keys: int | None = None
) -> list[OffloadKey]:
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


def encode_fetch(request_id: int, keys: Sequence[bytes]) -> bytes:
    return _REQUEST_ID.pack(request_id) + encode_key_list(keys)


def decode_fetch(
    body: bytes | bytearray | memoryview, max_keys: int
) -> tuple[int, list[OffloadKey]]:
    if len(body) < _REQUEST_ID.size:
        raise ProtocolError("truncated fetch request")
    (request_id,) = _REQUEST_ID.unpack_from(body, 0)
    keys = decode_key_list(body, _REQUEST_ID.size, max_keys)
    if not keys:
        raise ProtocolError("a fetch request for no keys")
    return request_id, keys


class Hello:
    """The first frame of each side of a handshake."""

    __slots__ = ("digest", "node_id", "nonce", "version")

    def __init__(self, version: int, node_id: bytes, nonce: bytes, digest: bytes) -> None:
        self.version = version
        self.node_id = node_id
        self.nonce = nonce
        self.digest = digest


def encode_hello(node_id: bytes, nonce: bytes, digest: bytes) -> bytes:
    return HELLO.pack(_MAGIC, PROTOCOL_VERSION, node_id, nonce, digest)


def decode_hello(body: bytes | bytearray | memoryview) -> Hello:
    if len(body) != HELLO.size:
        raise AuthError("malformed hello")
    magic, version, node_id, nonce, digest = HELLO.unpack(body)
    if magic != _MAGIC:
        raise AuthError("not a kvtier p2p peer")
    return Hello(version, node_id, nonce, digest)


# ------------------------------------------------------------------ channels


def tune_socket(sock: socket.socket) -> None:
    """Latency and liveness options every p2p connection uses."""
    # Fetch requests and announcements are small frames that must not wait for Nagle's
    # algorithm (up to 40 ms with delayed ACKs); chunks are large writes either way.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", _KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", _KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", _KEEPALIVE_COUNT),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class Channel:
    """A connected byte stream. At most one reader and one sender at a time.

    The owner of a channel serialises its sends (one frame at a time) and runs one
    reading coroutine; :meth:`close` is called once neither is running.
    """

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self._loop = asyncio.get_running_loop()

    async def recv_into(self, view: memoryview) -> int:
        """Read at least one byte into ``view``; 0 when the peer closed the stream."""
        raise NotImplementedError

    async def send(self, *buffers: bytes | bytearray | memoryview) -> None:
        """Send every byte of ``buffers``, in order."""
        raise NotImplementedError

    async def recv_exactly(self, view: memoryview) -> None:
        """Fill ``view`` completely.

        Raises:
            PeerClosed: the stream ended first.
        """
        size = len(view)
        got = await self.recv_into(view)
        while 0 < got < size:
            more = await self.recv_into(view[got:])
            if more == 0:
                break
            got += more
        if got < size:
            raise PeerClosed(
                "the peer closed the connection"
                if got == 0
                else f"the peer closed the connection {got} bytes into {size}"
            )

    def close(self) -> None:
        self.sock.close()


class PlainChannel(Channel):
    """TCP without TLS: the kernel copies straight between the socket and the buffers."""

    async def recv_into(self, view: memoryview) -> int:
        return await self._loop.sock_recv_into(self.sock, view)

    async def send(self, *buffers: bytes | bytearray | memoryview) -> None:
        for buffer in buffers:
            await self._loop.sock_sendall(self.sock, buffer)


class TlsChannel(Channel):
    """TLS over memory BIOs on a non-blocking socket.

    Ciphertext goes through one reusable buffer; plaintext is decrypted straight into
    the caller's memoryview, so a chunk lands in its primary slot without a copy of its
    own. No close_notify is sent: every frame carries its length, so a truncated stream
    is always detected.
    """

    def __init__(
        self,
        sock: socket.socket,
        peer: str,
        context: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
    ) -> None:
        super().__init__(sock, peer)
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._ssl = context.wrap_bio(
            self._incoming,
            self._outgoing,
            server_side=server_side,
            server_hostname=server_hostname,
        )
        self._raw = memoryview(bytearray(_TLS_READ_BYTES))

    async def handshake(self) -> None:
        """Run the TLS handshake.

        Raises:
            ssl.SSLError: the peer's certificate or protocol was refused.
            PeerClosed: the peer hung up during the handshake.
        """
        while True:
            try:
                self._ssl.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    raise PeerClosed(
                        "the peer closed the connection during the TLS handshake"
                    ) from None
        await self._flush()

    async def recv_into(self, view: memoryview) -> int:
        while True:
            try:
                # With a buffer, read() decrypts into it and returns a count.
                return cast(int, self._ssl.read(len(view), view))
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLZeroReturnError:
                return 0
            if not await self._fill():
                return 0

    async def send(self, *buffers: bytes | bytearray | memoryview) -> None:
        for buffer in buffers:
            view = memoryview(buffer)
            for start in range(0, len(view), _TLS_WRITE_BYTES):
                self._ssl.write(view[start : start + _TLS_WRITE_BYTES])
                await self._flush()

    async def _fill(self) -> bool:
        count = await self._loop.sock_recv_into(self.sock, self._raw)
        if count == 0:
            return False
        self._incoming.write(self._raw[:count])
        return True

    async def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            await self._loop.sock_sendall(self.sock, data)


async def send_frame(channel: Channel, kind: Kind, body: bytes = b"") -> None:
    await channel.send(FRAME.pack(kind, len(body)) + body)


async def read_frame(channel: Channel, max_body: int) -> tuple[Kind, bytearray]:
    """One whole frame whose body is at most ``max_body`` bytes.

    Raises:
        ProtocolError: a malformed header or a longer body.
        PeerClosed: the stream ended.
    """
    header = bytearray(FRAME.size)
    await channel.recv_exactly(memoryview(header))
    kind, length = parse_frame_header(header)
    if length > max_body:
        raise ProtocolError(f"a {kind.name} frame of {length} bytes, at most {max_body} allowed")
    body = bytearray(length)
    if length:
        await channel.recv_exactly(memoryview(body))
    return kind, body


# ----------------------------------------------------------------- handshake


async def _read_handshake_frame(channel: Channel, expected: Kind) -> bytearray:
    try:
        kind, body = await read_frame(channel, PREAUTH_MAX_BODY)
    except ProtocolError as exc:
        raise AuthError(f"before authentication: {exc}") from None
    if kind is Kind.REJECT:
        reason: Reject | None = None
        if len(body) == 1 and body[0] in _REJECT_CODES:
            reason = Reject(body[0])
        if reason is None:
            raise AuthError("the peer refused the connection")
        raise Rejected(reason)
    if kind is not expected:
        raise AuthError(f"expected a {expected.name} frame before authentication, got {kind.name}")
    return body


async def authenticate_reader(
    channel: Channel, secret: Secret, node_id: bytes, digest: bytes, nonce: bytes
) -> bytes:
    """The dialing side's handshake; returns the owner's node id.

    Raises:
        Rejected: the owner refused us (namespace, secret, version, or itself).
        SelfConnection: the owner is this node.
        AuthError: the owner failed to prove the secret, or broke the protocol.
    """
    await send_frame(channel, Kind.HELLO, encode_hello(node_id, nonce, digest))
    hello = decode_hello(await _read_handshake_frame(channel, Kind.HELLO))
    if hello.node_id == node_id:
        raise SelfConnection("the address is this node itself")
    if hello.version != PROTOCOL_VERSION:
        raise AuthError(f"the peer speaks protocol version {hello.version}")
    proof, expected = _proofs(
        secret, Role.READER, (node_id, nonce), (hello.node_id, hello.nonce), digest
    )
    await send_frame(channel, Kind.PROOF, proof)
    answer = await _read_handshake_frame(channel, Kind.PROOF)
    if not hmac.compare_digest(bytes(answer), expected):
        raise AuthError("the peer failed to prove the shared secret")
    return bytes(hello.node_id)


async def authenticate_owner(
    channel: Channel, secret: Secret, node_id: bytes, digest: bytes, nonce: bytes
) -> bytes:
    """The accepting side's handshake; returns the reader's node id.

    A refusal is sent as a REJECT frame before the error is raised.

    Raises:
        SelfConnection: the reader is this node.
        AuthError: wrong secret, namespace or version, or a bad frame.
    """
    hello = decode_hello(await _read_handshake_frame(channel, Kind.HELLO))
    refusal: tuple[Reject, AuthError] | None = None
    if hello.version != PROTOCOL_VERSION:
        refusal = Reject.VERSION, AuthError(f"the peer speaks protocol version {hello.version}")
    elif hello.node_id == node_id:
        refusal = Reject.SELF, SelfConnection("the peer is this node itself")
    elif not hmac.compare_digest(hello.digest, digest):
        refusal = Reject.NAMESPACE, AuthError("the peer serves another namespace")
    if refusal is not None:
        await _refuse(channel, refusal[0])
        raise refusal[1]
    await send_frame(channel, Kind.HELLO, encode_hello(node_id, nonce, bytes(DIGEST_BYTES)))
    proof = await _read_handshake_frame(channel, Kind.PROOF)
    answer, expected = _proofs(
        secret, Role.OWNER, (node_id, nonce), (hello.node_id, hello.nonce), digest
    )
    if not hmac.compare_digest(bytes(proof), expected):
        await _refuse(channel, Reject.AUTHENTICATION)
        raise AuthError("the peer failed to prove the shared secret")
    await send_frame(channel, Kind.PROOF, answer)
    return bytes(hello.node_id)


def _proofs(
    secret: Secret,
    role: Role,
    this: tuple[bytes, bytes],
    other: tuple[bytes, bytes],
    digest: bytes,
) -> tuple[bytes, bytes]:
    """This node's proof in ``role``, and the proof the other side must answer with.

    ``this`` and ``other`` are (node id, nonce) pairs.
    """
    other_role = Role.OWNER if role is Role.READER else Role.READER
    mine = secret.proof(
        role,
        prover_id=this[0],
        prover_nonce=this[1],
        challenger_id=other[0],
        challenger_nonce=other[1],
        digest=digest,
    )
    theirs = secret.proof(
        other_role,
        prover_id=other[0],
        prover_nonce=other[1],
        challenger_id=this[0],
        challenger_nonce=this[1],
        digest=digest,
    )
    return mine, theirs


async def _refuse(channel: Channel, reason: Reject) -> None:
    # Best effort: the peer may already be gone, and the caller closes anyway.
    with contextlib.suppress(OSError, LinkError):
        await send_frame(channel, Kind.REJECT, bytes([reason]))
