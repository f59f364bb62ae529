"""Why a p2p connection ends.

Each error ends one connection, never the tier: the dialer redials, the server keeps
accepting. Messages are safe to log: they never carry the secret.
"""

from __future__ import annotations

import enum

__all__ = [
    "AuthError",
    "LinkError",
    "PeerClosed",
    "ProtocolError",
    "Reject",
    "Rejected",
    "SelfConnection",
]


class Reject(enum.IntEnum):
    """Why an owner refused a connection (the byte of a REJECT frame)."""

    VERSION = 1
    NAMESPACE = 2
    AUTHENTICATION = 3
    SELF = 4

    @property
    def reason(self) -> str:
        return _REJECT_REASONS[self]


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
