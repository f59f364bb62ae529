"""An in-memory transport: connected channel pairs inside one event loop.

For tests: nodes on one :class:`MemoryTransport` reach each other by ``host:port``
exactly as over TCP, without sockets, ports or timing. Each direction of a pair is a
bounded buffer, so a sender that nobody reads from waits as it would on a full socket.
"""

from __future__ import annotations

import asyncio
import itertools

from kvtier.tiers.p2p.channel import Buffer, Channel, Listener, Transport, format_address

__all__ = ["MemoryChannel", "MemoryListener", "MemoryTransport", "channel_pair"]

# Bytes in flight per direction: about a loopback socket's buffers, so that a large
# send is taken in several pieces as it would be over TCP.
DEFAULT_PIPE_BYTES = 256 * 1024
# Ports handed out for port 0 and to dialing ends, above the well-known range.
_FIRST_PORT = 40000


class _Pipe:
    """One direction of a channel pair: a bounded byte buffer with waiting ends."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._buffer = bytearray()
        #: The sending end closed: the reader gets what is left, then end of stream.
        self._ended = False
        #: The receiving end closed: nobody will ever read again.
        self._broken = False
        self._changed = asyncio.Event()

    async def write(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        while view:
            if self._ended or self._broken:
                raise BrokenPipeError("the channel is closed")
            room = self._capacity - len(self._buffer)
            if room <= 0:
                self._changed.clear()
                await self._changed.wait()
                continue
            self._buffer += view[:room]
            view = view[room:]
            self._changed.set()

    async def read_into(self, target: memoryview) -> int:
        while not self._buffer:
            if self._ended:
                return 0
            if self._broken:
                raise ConnectionResetError("the channel is closed")
            self._changed.clear()
            await self._changed.wait()
        # Copied only in this step: a cancelled reader never gets here.
        count = min(len(target), len(self._buffer))
        target[:count] = self._buffer[:count]
        del self._buffer[:count]
        self._changed.set()
        return count

    def end(self) -> None:
        self._ended = True
        self._changed.set()

    def break_(self) -> None:
        self._broken = True
        self._buffer.clear()
        self._changed.set()


class MemoryChannel(Channel):
    """One end of a connected pair (see :func:`channel_pair`)."""

    def __init__(self, peer: str, incoming: _Pipe, outgoing: _Pipe) -> None:
        super().__init__(peer)
        self._incoming = incoming
        self._outgoing = outgoing
        self.closed = False

    async def recv_into(self, view: memoryview) -> int:
        if self.closed:
            raise OSError("recv on a closed channel")
        return await self._incoming.read_into(view)

    async def send(self, *buffers: Buffer) -> None:
        for buffer in buffers:
            if self.closed:
                raise OSError("send on a closed channel")
            await self._outgoing.write(buffer)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._outgoing.end()
            self._incoming.break_()


def channel_pair(
    a_label: str = "a:1", b_label: str = "b:1", *, capacity: int = DEFAULT_PIPE_BYTES
) -> tuple[MemoryChannel, MemoryChannel]:
    """Two connected channels: what one sends, the other receives.

    Each end's ``peer`` names the other end: ``a`` has ``peer == b_label``.
    """
    a_to_b, b_to_a = _Pipe(capacity), _Pipe(capacity)
    return MemoryChannel(b_label, b_to_a, a_to_b), MemoryChannel(a_label, a_to_b, b_to_a)


class MemoryListener(Listener):
    """Dialed channels wait in a queue of ``backlog`` until accepted."""

    def __init__(self, address: tuple[str, int], backlog: int) -> None:
        self._address = address
        self._waiting: asyncio.Queue[MemoryChannel] = asyncio.Queue(backlog)
        self.closed = False

    @property
    def address(self) -> tuple[str, int]:
        return self._address

    async def accept(self) -> Channel:
        if self.closed:
            raise OSError("accept on a closed listener")
        return await self._waiting.get()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        while not self._waiting.empty():
            self._waiting.get_nowait().close()

    def offer(self, channel: MemoryChannel) -> bool:
        """Queue a dialed channel for :meth:`accept`; False when closed or the backlog is full."""
        if self.closed:
            return False
        try:
            self._waiting.put_nowait(channel)
        except asyncio.QueueFull:
            return False
        return True


class MemoryTransport(Transport):
    """Listeners by ``(host, port)`` in a dictionary; any host name is valid.

    Every node of one test shares one instance, as the nodes of a cluster share a
    network.
    """

    def __init__(self, *, capacity: int = DEFAULT_PIPE_BYTES) -> None:
        self._capacity = capacity
        self._listeners: dict[tuple[str, int], MemoryListener] = {}
        self._ports = itertools.count(_FIRST_PORT)

    async def connect(self, host: str, port: int) -> Channel:
        where = format_address((host, port))
        listener = self._listeners.get((host, port))
        dialer = format_address(("memory", next(self._ports)))
        mine, theirs = channel_pair(dialer, where, capacity=self._capacity)
        if listener is None or not listener.offer(theirs):
            raise ConnectionRefusedError(f"nobody accepts connections on {where}")
        return mine

    async def listen(self, host: str, port: int, *, backlog: int) -> Listener:
        if port == 0:
            port = next(p for p in self._ports if not self._bound(host, p))
        if self._bound(host, port):
            raise OSError(f"{format_address((host, port))} is in use")
        listener = MemoryListener((host, port), backlog)
        self._listeners[(host, port)] = listener
        return listener

    def _bound(self, host: str, port: int) -> bool:
        listener = self._listeners.get((host, port))
        return listener is not None and not listener.closed
