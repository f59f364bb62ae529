"""Authenticating a fresh channel: optional mutual TLS, then a shared-secret handshake.

Before the handshake ends only HELLO, PROOF and REJECT frames of at most
:data:`PREAUTH_MAX_BODY` bytes are accepted:

1. reader -> owner: HELLO with the protocol version it proposes and its namespace
   digest. The owner refuses (REJECT) a version older than :data:`MIN_PROTOCOL_VERSION`,
   another namespace, or its own node id (a node dialing itself).
2. owner -> reader: HELLO with the version the connection speaks, the lower of the
   proposed one and its own (its digest zeroed: it reveals nothing before the reader
   proved the secret). The reader hangs up on a version it did not offer.
3. reader -> owner: PROOF("reader"); the owner checks it with ``hmac.compare_digest``
   and REJECTs a wrong one.
4. owner -> reader: PROOF("owner"); the reader checks it and hangs up on a wrong one.

A HELLO body is magic (8), version (2), node id (16), nonce (32), namespace digest (16).

Versions. 1: the frames of :mod:`~kvtier.tiers.p2p.wire` but CORRUPT; 2: CORRUPT too.
A version-1 owner refuses any other version, so a reader whose proposal of 2 is refused
for its version dials again proposing 1 (:class:`~kvtier.tiers.p2p.reader.Dialer`); a
version-1 reader proposes 1 and a newer owner answers 1. Nothing authenticates the
proposal itself: whoever can tamper with the stream can make two nodes speak version 1,
which loses only the reports of corrupt chunks (the reader backs off all the same).
Each proof (:func:`proof`) is keyed by the secret and covers a fixed context string,
the prover's role, both nonces, both node ids and the namespace digest, so a proof
cannot be replayed on another connection, reflected back to its sender, or reused
across namespaces.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import hmac
import secrets
import ssl
import struct
from dataclasses import dataclass

from kvtier.tiers.kit import Secret
from kvtier.tiers.p2p.channel import Buffer, Channel, TlsChannel
from kvtier.tiers.p2p.errors import (
    AuthError,
    LinkError,
    ProtocolError,
    Reject,
    Rejected,
    SelfConnection,
)
from kvtier.tiers.p2p.wire import Kind, read_frame, send_frame

__all__ = [
    "HELLO",
    "MIN_PROTOCOL_VERSION",
    "NODE_ID_BYTES",
    "NONCE_BYTES",
    "PREAUTH_MAX_BODY",
    "PROTOCOL_VERSION",
    "Credentials",
    "Hello",
    "Remote",
    "Role",
    "authenticate_owner",
    "authenticate_reader",
    "decode_hello",
    "encode_hello",
    "proof",
]

#: The version this node proposes: 2 adds the CORRUPT frame.
PROTOCOL_VERSION = 2
#: The oldest version this node still speaks, as a reader or an owner.
MIN_PROTOCOL_VERSION = 1
_MAGIC = b"KVTP2P\r\n"
_CONTEXT = b"kvtier p2p handshake v1\0"

HELLO = struct.Struct(">8sH16s32s16s")
NODE_ID_BYTES = 16
NONCE_BYTES = 32
DIGEST_BYTES = 16
#: No frame before authentication is longer than a HELLO; anything bigger is an attack
#: or another protocol, and is refused before a buffer is allocated for it.
PREAUTH_MAX_BODY = 256

_REJECT_CODES = frozenset(int(member) for member in Reject)


class Role(enum.Enum):
    """Which end of a connection a node is."""

    #: Dialed the connection; reads the owner's index and pulls chunks.
    READER = b"reader"
    #: Accepted the connection; announces its keys and serves chunks.
    OWNER = b"owner"


@dataclass(frozen=True)
class Hello:
    """The first frame of each side of a handshake."""

    version: int
    node_id: bytes
    nonce: bytes
    digest: bytes


@dataclass(frozen=True)
class Remote:
    """The other end of an authenticated connection."""

    node_id: bytes
    #: The protocol version both ends speak on this connection.
    version: int


def encode_hello(
    node_id: bytes, nonce: bytes, digest: bytes, version: int = PROTOCOL_VERSION
) -> bytes:
    return HELLO.pack(_MAGIC, version, node_id, nonce, digest)


def decode_hello(body: Buffer) -> Hello:
    """Raises AuthError for anything but a well-formed kvtier HELLO (any version)."""
    if len(body) != HELLO.size:
        raise AuthError("malformed hello")
    magic, version, node_id, nonce, digest = HELLO.unpack(body)
    if magic != _MAGIC:
        raise AuthError("not a kvtier p2p peer")
    return Hello(version, node_id, nonce, digest)


def proof(
    secret: Secret[bytes],
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
    return hmac.new(secret.value, message, hashlib.sha256).digest()


async def authenticate_reader(
    channel: Channel,
    secret: Secret[bytes],
    node_id: bytes,
    digest: bytes,
    nonce: bytes,
    version: int = PROTOCOL_VERSION,
) -> Remote:
    """The dialing side's handshake, proposing ``version``; returns the owner.

    Raises:
        Rejected: the owner refused us (namespace, secret, version, or itself).
        SelfConnection: the owner is this node.
        AuthError: the owner failed to prove the secret, answered a version outside
            [MIN_PROTOCOL_VERSION, ``version``], or broke the protocol.
    """
    await send_frame(channel, Kind.HELLO, encode_hello(node_id, nonce, digest, version))
    hello = decode_hello(await _read_handshake_frame(channel, Kind.HELLO))
    if hello.node_id == node_id:
        raise SelfConnection("the address is this node itself")
    if not MIN_PROTOCOL_VERSION <= hello.version <= version:
        raise AuthError(f"the peer speaks protocol version {hello.version}")
    mine, expected = _proofs(
        secret, Role.READER, (node_id, nonce), (hello.node_id, hello.nonce), digest
    )
    await send_frame(channel, Kind.PROOF, mine)
    answer = await _read_handshake_frame(channel, Kind.PROOF)
    if not hmac.compare_digest(bytes(answer), expected):
        raise AuthError("the peer failed to prove the shared secret")
    return Remote(bytes(hello.node_id), hello.version)


async def authenticate_owner(
    channel: Channel, secret: Secret[bytes], node_id: bytes, digest: bytes, nonce: bytes
) -> Remote:
    """The accepting side's handshake; returns the reader.

    A refusal is sent as a REJECT frame before the error is raised.

    Raises:
        SelfConnection: the reader is this node.
        AuthError: wrong secret or namespace, a version older than
            MIN_PROTOCOL_VERSION, or a bad frame.
    """
    hello = decode_hello(await _read_handshake_frame(channel, Kind.HELLO))
    refusal: tuple[Reject, AuthError] | None = None
    if hello.version < MIN_PROTOCOL_VERSION:
        refusal = Reject.VERSION, AuthError(f"the peer speaks protocol version {hello.version}")
    elif hello.node_id == node_id:
        refusal = Reject.SELF, SelfConnection("the peer is this node itself")
    elif not hmac.compare_digest(hello.digest, digest):
        refusal = Reject.NAMESPACE, AuthError("the peer serves another namespace")
    if refusal is not None:
        await _refuse(channel, refusal[0])
        raise refusal[1]
    version = min(hello.version, PROTOCOL_VERSION)
    reply = encode_hello(node_id, nonce, bytes(DIGEST_BYTES), version)
    await send_frame(channel, Kind.HELLO, reply)
    given = await _read_handshake_frame(channel, Kind.PROOF)
    answer, expected = _proofs(
        secret, Role.OWNER, (node_id, nonce), (hello.node_id, hello.nonce), digest
    )
    if not hmac.compare_digest(bytes(given), expected):
        await _refuse(channel, Reject.AUTHENTICATION)
        raise AuthError("the peer failed to prove the shared secret")
    await send_frame(channel, Kind.PROOF, answer)
    return Remote(bytes(hello.node_id), version)


@dataclass(frozen=True)
class Credentials:
    """What a node proves itself with on every connection, in both directions."""

    secret: Secret[bytes]
    #: This node's random identity: a node that reaches itself finds out.
    node_id: bytes
    #: The namespace digest: nodes of another model, dtype or geometry are refused.
    digest: bytes
    #: Mutual TLS contexts for the connections this node dials and those it accepts;
    #: None for both without TLS.
    client_tls: ssl.SSLContext | None = None
    server_tls: ssl.SSLContext | None = None

    async def as_reader(
        self, channel: Channel, host: str, version: int = PROTOCOL_VERSION
    ) -> tuple[Channel, Remote]:
        """Secure and authenticate a channel this node dialed to ``host``, proposing
        protocol ``version``.

        Returns the channel to use from now on and the owner. The caller closes
        ``channel`` if this raises.

        Raises:
            Rejected, SelfConnection, AuthError: see :func:`authenticate_reader`.
            ssl.SSLError: the owner's certificate was refused, or it refused ours.
        """
        if self.client_tls is not None:
            tls = TlsChannel(channel, self.client_tls, server_side=False, server_hostname=host)
            await tls.handshake()
            channel = tls
        nonce = secrets.token_bytes(NONCE_BYTES)
        owner = await authenticate_reader(
            channel, self.secret, self.node_id, self.digest, nonce, version
        )
        return channel, owner

    async def as_owner(self, channel: Channel) -> tuple[Channel, Remote]:
        """Secure and authenticate a channel a peer opened to this node.

        Returns the channel to use from now on and the reader. The caller closes
        ``channel`` if this raises.

        Raises:
            SelfConnection, AuthError: see :func:`authenticate_owner`.
            ssl.SSLError: the reader's certificate was refused.
        """
        if self.server_tls is not None:
            tls = TlsChannel(channel, self.server_tls, server_side=True)
            await tls.handshake()
            channel = tls
        nonce = secrets.token_bytes(NONCE_BYTES)
        reader = await authenticate_owner(channel, self.secret, self.node_id, self.digest, nonce)
        return channel, reader


async def _read_handshake_frame(channel: Channel, expected: Kind) -> bytearray:
    try:
        kind, body = await read_frame(channel, PREAUTH_MAX_BODY)
    except ProtocolError as exc:
        raise AuthError(f"before authentication: {exc}") from None
    if kind is Kind.REJECT:
        if len(body) == 1 and body[0] in _REJECT_CODES:
            raise Rejected(Reject(body[0]))
        raise AuthError("the peer refused the connection")
    if kind is not expected:
        raise AuthError(f"expected a {expected.name} frame before authentication, got {kind.name}")
    return body


def _proofs(
    secret: Secret[bytes],
    role: Role,
    this: tuple[bytes, bytes],
    other: tuple[bytes, bytes],
    digest: bytes,
) -> tuple[bytes, bytes]:
    """This node's proof in ``role``, and the proof the other side must answer with.

    ``this`` and ``other`` are (node id, nonce) pairs.
    """
    other_role = Role.OWNER if role is Role.READER else Role.READER
    mine = proof(
        secret,
        role,
        prover_id=this[0],
        prover_nonce=this[1],
        challenger_id=other[0],
        challenger_nonce=other[1],
        digest=digest,
    )
    theirs = proof(
        secret,
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
