"""The default transport: TCP sockets driven by the event loop's socket calls.

:class:`SocketChannel` calls ``loop.sock_recv_into`` / ``loop.sock_sendall``, which
hand the kernel the caller's memoryview. asyncio streams copy every read into a new
``bytes``; they measured 38 % of raw loopback TCP here, the socket calls ~100 %.
"""

from __future__ import annotations

import asyncio
import socket

from kvtier.tiers.p2p.channel import Buffer, Channel, Listener, Transport, format_address

__all__ = ["SocketChannel", "SocketListener", "SocketTransport", "tune_socket"]

# TCP keepalive: a peer host that vanishes without a FIN or RST (power loss, a network
# partition) is noticed on an idle connection after about 10 + 3 * 5 = 25 s. Busy
# connections notice sooner through io_timeout_s.
_KEEPALIVE_IDLE_S = 10
_KEEPALIVE_INTERVAL_S = 5
_KEEPALIVE_COUNT = 3


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


class SocketChannel(Channel):
    """A connected non-blocking TCP socket: the kernel copies straight between it and
    the buffers."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        super().__init__(peer)
        self.sock = sock
        self._loop = asyncio.get_running_loop()

    async def recv_into(self, view: memoryview) -> int:
        return await self._loop.sock_recv_into(self.sock, view)

    async def send(self, *buffers: Buffer) -> None:
        for buffer in buffers:
            await self._loop.sock_sendall(self.sock, buffer)

    def close(self) -> None:
        self.sock.close()


class SocketListener(Listener):
    """A listening TCP socket; accepted connections come tuned (:func:`tune_socket`)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return host, port

    async def accept(self) -> Channel:
        while True:
            sock, address = await self._loop.sock_accept(self._sock)
            try:
                tune_socket(sock)
            except OSError:
                # Reset before it could be tuned: nobody is left to serve.
                sock.close()
                continue
            return SocketChannel(sock, format_address(address[:2]))

    def close(self) -> None:
        self._sock.close()


class SocketTransport(Transport):
    """TCP over the operating system's sockets."""

    async def connect(self, host: str, port: int) -> Channel:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        error: OSError = OSError(f"no address for {host}")
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                await loop.sock_connect(sock, address)
                tune_socket(sock)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            except BaseException:
                sock.close()
                raise
            return SocketChannel(sock, format_address((host, port)))
        raise error

    async def listen(self, host: str, port: int, *, backlog: int) -> Listener:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            # A restarted node takes its port back while old connections sit in TIME_WAIT.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(min(socket.SOMAXCONN, backlog))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return SocketListener(sock)
