"""Byte channels between nodes, and the transport that opens them.

A :class:`Transport` dials (:meth:`~Transport.connect`) and listens
(:meth:`~Transport.listen`); both give :class:`Channel` objects, connected byte streams
that move bytes between the peer and caller-owned buffers with no copy of their own.
The tier takes its transport by injection: :class:`~kvtier.tiers.p2p.sockets.SocketTransport`
by default, :class:`~kvtier.tiers.p2p.memory.MemoryTransport` in tests. TLS is not a
transport but a wrapper over any channel (:class:`TlsChannel`), so it runs over the
in-memory transport as well as over TCP.
"""

from __future__ import annotations

import ssl
from abc import ABC, abstractmethod
from typing import ClassVar, TypeAlias, cast

from kvtier.resources import BlockingResource
from kvtier.tiers.p2p.errors import PeerClosed

__all__ = ["Buffer", "Channel", "Listener", "TlsChannel", "Transport", "format_address"]

#: What a channel sends: any contiguous bytes, never copied by the channel itself.
Buffer: TypeAlias = bytes | bytearray | memoryview

# Ciphertext is read from the inner channel in pieces of this size: a 256 KiB read
# drains a loopback socket buffer in one call while keeping the decrypt of one piece
# (~0.1 ms with AES-NI) short enough not to stall the event loop.
_TLS_READ_BYTES = 256 * 1024
# Plaintext is encrypted and sent in pieces of this size for the same reason.
_TLS_WRITE_BYTES = 256 * 1024


def format_address(address: tuple[str, int]) -> str:
    """``"host:port"`` as a peer would list it (``"[::1]:7070"`` for IPv6)."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Channel(BlockingResource):
    """A connected, reliable byte stream to one peer.

    At most one coroutine reads and one sends at a time: the owner of a channel
    serialises its sends (one frame at a time) and runs one reading coroutine.
    """

    close_blocks: ClassVar[bool] = False

    def __init__(self, peer: str) -> None:
        #: How logs name the other end (``"host:port"``).
        self.peer = peer

    @abstractmethod
    async def recv_into(self, view: memoryview) -> int:
        """Read at least one byte into ``view``; 0 when the peer closed the stream.

        Once a cancellation reaches the calling task, no byte lands in ``view`` any
        more: a reader that is cancelled may hand the slot it was filling to someone
        else at once.

        Raises:
            OSError: the connection broke.
        """

    @abstractmethod
    async def send(self, *buffers: Buffer) -> None:
        """Send every byte of ``buffers``, in order.

        Raises:
            OSError: the connection broke.
        """

    @abstractmethod
    def close(self) -> None:
        """End the stream at once. Idempotent; safe from a done callback (it never awaits)."""

    async def recv_exactly(self, view: memoryview) -> None:
        """Fill ``view`` completely.

        Raises:
            PeerClosed: the stream ended first.
            OSError: the connection broke.
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


class Listener(BlockingResource):
    """Channels that peers open to one address."""

    close_blocks: ClassVar[bool] = False

    @property
    @abstractmethod
    def address(self) -> tuple[str, int]:
        """The bound ``(host, port)``: the real port when port 0 was asked for."""

    @abstractmethod
    async def accept(self) -> Channel:
        """The next channel a peer opened.

        Raises:
            OSError: accepting failed (out of file descriptors, say); the caller waits
                a little and accepts again.
        """

    @abstractmethod
    def close(self) -> None:
        """Stop listening. Channels already accepted stay open. Idempotent."""


class Transport(ABC):
    """Opens channels to peers and listens for theirs."""

    @abstractmethod
    async def connect(self, host: str, port: int) -> Channel:
        """A channel to the node listening on ``host:port``.

        Raises:
            OSError: nobody listens there, or the host cannot be reached or resolved.
        """

    @abstractmethod
    async def listen(self, host: str, port: int, *, backlog: int) -> Listener:
        """Listen on ``host:port`` (port 0: any free port).

        ``backlog`` bounds the connections waiting to be accepted.

        Raises:
            socket.gaierror: ``host`` cannot be resolved.
            OSError: the address cannot be bound (in use, not local).
        """


class TlsChannel(Channel):
    """TLS over another channel, through memory BIOs.

    Ciphertext goes through one reusable buffer; plaintext is decrypted straight into
    the caller's memoryview, so a chunk lands in its primary slot without a copy of its
    own. No close_notify is sent: every frame carries its length, so a truncated stream
    is always detected.
    """

    def __init__(
        self,
        inner: Channel,
        context: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
    ) -> None:
        super().__init__(inner.peer)
        self._inner = inner
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

    async def send(self, *buffers: Buffer) -> None:
        for buffer in buffers:
            view = memoryview(buffer)
            for start in range(0, len(view), _TLS_WRITE_BYTES):
                self._ssl.write(view[start : start + _TLS_WRITE_BYTES])
                await self._flush()

    def close(self) -> None:
        self._inner.close()

    async def _fill(self) -> bool:
        count = await self._inner.recv_into(self._raw)
        if count == 0:
            return False
        self._incoming.write(self._raw[:count])
        return True

    async def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            await self._inner.send(data)
