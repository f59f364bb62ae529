"""The p2p tier's parameters, parsed and checked once.

:meth:`PeerSettings.from_params` opens nothing: it runs whenever a configuration is
checked. The files a configuration names (``secret_file``, the TLS certificates) are
read when the tier starts, in a thread: :func:`read_secret_file`,
:meth:`TlsSettings.contexts`.
"""

from __future__ import annotations

import dataclasses
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.tiers import kit
from kvtier.tiers.kit import ConfigError, ConfigReader, Secret, parse_address
from kvtier.tiers.p2p.channel import format_address
from kvtier.tiers.p2p.wire import CONTROL_BATCH_BYTES, chunk_body_bytes

__all__ = [
    "MIN_SECRET_BYTES",
    "PeerSettings",
    "TlsSettings",
    "read_secret_file",
]

DEFAULT_LISTEN = ("127.0.0.1", 0)
# Connecting, the TLS handshake and the secret handshake together: a few round trips,
# so 5 s only expires for a host that is down or a listener that never answers.
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# A frame begun but not finished, or a fetch answered by nothing at all, for this long
# means the peer is gone. A 2 MiB chunk takes under 2 ms on a 10 Gb/s link, so 10 s
# only fires on a dead or wedged peer, never on a slow one.
DEFAULT_IO_TIMEOUT_S = 10.0
# Redialing a lost peer: 0.1 s, doubling to 5 s, each wait drawn from [half, all] of
# the step so that many readers of one restarted node do not redial in lockstep.
DEFAULT_RECONNECT_INITIAL_S = 0.1
DEFAULT_RECONNECT_MAX_S = 5.0
# A chunk from a peer that failed verification: that peer is not asked for that key
# again for 1 s, doubling after each further failure up to 60 s, and back to none after
# a good transfer. A flipped bit on a link is a burst that has long passed after 1 s;
# a link that corrupts everything costs one wasted chunk a minute per key at worst,
# while the owner, told of each failure, withdraws the key if its own row changed.
DEFAULT_RETRY_CORRUPT_AFTER_S = 1.0
DEFAULT_RETRY_CORRUPT_MAX_S = 60.0
# Accepted connections at once, authenticated or not: a flood of half-open handshakes
# cannot use up this process's file descriptors.
DEFAULT_MAX_INBOUND = 64
#: The shortest secret accepted: 128 bits, if it is random.
MIN_SECRET_BYTES = 16
# The default frame limit is one chunk frame plus this: room for every control frame,
# which senders cut at CONTROL_BATCH_BYTES.
FRAME_SLACK = 64 * 1024
# Any frame limit must hold two control batches, whatever the chunk size.
_MIN_FRAME_BYTES = 2 * CONTROL_BATCH_BYTES
_MAX_FRAME_BYTES = 1 << 40


@dataclass(frozen=True)
class TlsSettings:
    """Mutual TLS (parameter ``tls``): both sides present a certificate signed by ``ca``."""

    #: ``cert``: PEM file of this node's certificate (chain).
    cert: str
    #: ``key``: PEM file of that certificate's private key.
    key: str
    #: ``ca``: PEM file of the authority whose certificates peers must present.
    ca: str
    #: ``check_hostname``: a dialed peer's certificate must name the host it was dialed
    #: as (default true).
    check_hostname: bool = True

    @classmethod
    def from_params(cls, params: Mapping[str, Any], path: str) -> TlsSettings:
        reader = ConfigReader(params, path)
        settings = cls(
            cert=reader.string("cert"),
            key=reader.string("key"),
            ca=reader.string("ca"),
            check_hostname=reader.boolean("check_hostname", True),
        )
        reader.reject_unknown()
        return settings

    def contexts(self, path: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        """Server and client contexts. Reads the files: run it in a thread.

        Raises:
            ConfigError: a file cannot be loaded (named by ``path.cert`` or ``path.ca``).
        """
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        for context in (server, client):
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                context.load_cert_chain(self.cert, self.key)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"{path}.cert", f"cannot load {self.cert} with key {self.key}: {exc}"
                ) from None
            try:
                context.load_verify_locations(cafile=self.ca)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"{path}.ca", f"cannot load {self.ca}: {exc}") from None
        # Both sides prove who they are: a peer without a certificate from ``ca`` is refused.
        server.verify_mode = ssl.CERT_REQUIRED
        # Sessions are long-lived and never resumed: no tickets to send or store.
        server.num_tickets = 0
        client.check_hostname = self.check_hostname
        client.verify_mode = ssl.CERT_REQUIRED
        return server, client


@dataclass(frozen=True)
class PeerSettings:
    """The p2p tier's parameters. Each field's comment is its reference documentation."""

    #: ``listen`` (``"host:port"``, default ``"127.0.0.1:0"``): where peers reach this
    #: node; port 0 picks a free port (see ``PeerTier.address``).
    listen: tuple[str, int] = DEFAULT_LISTEN
    #: ``peers`` (list of ``"host:port"``): the nodes whose primary tiers this node
    #: reads. A node that only serves lists none.
    peers: tuple[tuple[str, int], ...] = ()
    #: ``secret``: the shared secret, at least 16 bytes. Exactly one of ``secret`` and
    #: ``secret_file`` is required.
    secret: Secret[bytes] | None = None
    #: ``secret_file``: a file holding the secret (a trailing newline is ignored); it
    #: must not be accessible to its group or others. Read when the tier starts.
    secret_file: str | None = None
    #: ``tls`` (``{"cert", "key", "ca", "check_hostname"}``): mutual TLS; none by default.
    tls: TlsSettings | None = None
    #: ``connect_timeout_s`` (5): connecting plus both handshakes.
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    #: ``io_timeout_s`` (10): the longest a frame may take, or a fetch go unanswered.
    io_timeout_s: float = DEFAULT_IO_TIMEOUT_S
    #: ``max_frame_bytes`` (one chunk frame + 64 KiB): the longest frame accepted; at
    #: least one chunk frame and 64 KiB. None here means the default.
    max_frame_bytes: int | None = None
    #: ``reconnect_initial_s`` / ``reconnect_max_s`` (0.1 / 5): the first wait before
    #: redialing a lost peer, doubling up to the second.
    reconnect_initial_s: float = DEFAULT_RECONNECT_INITIAL_S
    reconnect_max_s: float = DEFAULT_RECONNECT_MAX_S
    #: ``retry_corrupt_after_s`` / ``retry_corrupt_max_s`` (1 / 60): after a chunk from
    #: a peer fails verification, lookups skip that peer's copy of that key this long,
    #: the wait doubling with each further failure up to the second; a good transfer
    #: ends it.
    retry_corrupt_after_s: float = DEFAULT_RETRY_CORRUPT_AFTER_S
    retry_corrupt_max_s: float = DEFAULT_RETRY_CORRUPT_MAX_S
    #: ``max_inbound_connections`` (64): accepted connections at once, authenticated
    #: or not; more are closed at once.
    max_inbound_connections: int = DEFAULT_MAX_INBOUND

    @classmethod
    def from_params(cls, params: Mapping[str, Any], path: str) -> PeerSettings:
        """Parse the tier's parameters.

        Raises:
            ConfigError: a parameter is missing, invalid or unknown; the message names
                ``path.<parameter>`` and never shows the secret.
        """
        reader = ConfigReader(params, path)
        listen = parse_address(
            reader.string("listen", format_address(DEFAULT_LISTEN)),
            reader.path_of("listen"),
            listen=True,
        )
        peers: list[tuple[str, int]] = []
        for i, peer in enumerate(reader.string_list("peers", [])):
            address = parse_address(peer, f"{reader.path_of('peers')}[{i}]", listen=False)
            if address in peers:
                raise ConfigError(f"{reader.path_of('peers')}[{i}]", f"{peer} is listed twice")
            peers.append(address)
        secret_text: str | None = reader.string("secret", None, secret=True)
        secret_file: str | None = reader.string("secret_file", None)
        if (secret_text is None) == (secret_file is None):
            raise ConfigError(
                reader.path_of("secret"), "exactly one of secret or secret_file is required"
            )
        secret = None
        if secret_text is not None:
            if len(secret_text.encode()) < MIN_SECRET_BYTES:
                raise ConfigError(
                    reader.path_of("secret"),
                    f"expected at least {MIN_SECRET_BYTES} bytes (use a random string of 32 "
                    "characters or more)",
                )
            secret = Secret(secret_text.encode())
        tls_params = reader.mapping("tls", None)
        tls = (
            None
            if tls_params is None
            else TlsSettings.from_params(tls_params, reader.path_of("tls"))
        )
        connect_timeout_s = reader.number(
            "connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S, minimum=0, exclusive_minimum=True
        )
        io_timeout_s = reader.number(
            "io_timeout_s", DEFAULT_IO_TIMEOUT_S, minimum=0, exclusive_minimum=True
        )
        max_frame_bytes = reader.integer(
            "max_frame_bytes", None, minimum=_MIN_FRAME_BYTES, maximum=_MAX_FRAME_BYTES
        )
        reconnect_initial_s = reader.number(
            "reconnect_initial_s", DEFAULT_RECONNECT_INITIAL_S, minimum=0, exclusive_minimum=True
        )
        reconnect_max_s = reader.number(
            "reconnect_max_s",
            max(DEFAULT_RECONNECT_MAX_S, reconnect_initial_s),
            minimum=reconnect_initial_s,
        )
        retry_corrupt_after_s = reader.number(
            "retry_corrupt_after_s",
            DEFAULT_RETRY_CORRUPT_AFTER_S,
            minimum=0,
            exclusive_minimum=True,
        )
        retry_corrupt_max_s = reader.number(
            "retry_corrupt_max_s",
            max(DEFAULT_RETRY_CORRUPT_MAX_S, retry_corrupt_after_s),
            minimum=retry_corrupt_after_s,
        )
        max_inbound = reader.integer(
            "max_inbound_connections", DEFAULT_MAX_INBOUND, minimum=1, maximum=65536
        )
        reader.reject_unknown()
        return cls(
            listen=listen,
            peers=tuple(peers),
            secret=secret,
            secret_file=secret_file,
            tls=tls,
            connect_timeout_s=connect_timeout_s,
            io_timeout_s=io_timeout_s,
            max_frame_bytes=max_frame_bytes,
            reconnect_initial_s=reconnect_initial_s,
            reconnect_max_s=reconnect_max_s,
            retry_corrupt_after_s=retry_corrupt_after_s,
            retry_corrupt_max_s=retry_corrupt_max_s,
            max_inbound_connections=max_inbound,
        )

    def for_chunks(self, chunk_bytes: int, path: str) -> PeerSettings:
        """These settings for rows of ``chunk_bytes``: ``max_frame_bytes`` filled in
        (:meth:`frame_limit`)."""
        return dataclasses.replace(self, max_frame_bytes=self.frame_limit(chunk_bytes, path))

    def frame_limit(self, chunk_bytes: int, path: str) -> int:
        """The frame limit for rows of ``chunk_bytes``: the setting, or its default.

        Raises:
            ConfigError: ``max_frame_bytes`` cannot hold one chunk frame.
        """
        smallest = chunk_body_bytes(chunk_bytes)
        if self.max_frame_bytes is None:
            return smallest + FRAME_SLACK
        if self.max_frame_bytes < smallest:
            raise ConfigError(
                f"{path}.max_frame_bytes",
                f"expected a value >= {max(smallest, _MIN_FRAME_BYTES)}, "
                f"got {self.max_frame_bytes}",
            )
        return self.max_frame_bytes


def read_secret_file(path: str, config_path: str) -> Secret[bytes]:
    """Read ``secret_file``: a file only its owner may access, holding at least
    :data:`MIN_SECRET_BYTES` bytes. Runs in a thread.

    Raises:
        ConfigError: see :func:`kvtier.tiers.kit.read_secret_file`.
    """
    return kit.read_secret_file(path, config_path, min_bytes=MIN_SECRET_BYTES)
