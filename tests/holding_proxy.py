"""A TCP relay on loopback that can hold back the answer to one request.

It sits between a tier and its server (an S3 server, a p2p peer) and passes bytes
both ways. :meth:`HoldingProxy.hold_next` picks the next request that comes through
(with ``http``, the next whose method matches; otherwise the next bytes a client
sends): that request goes on to the server, but nothing more reaches its client on
that connection until the hold ends. The hold is a :class:`~kvtier.testing.Stall`:
reached when the request passed, given up when its client closed the connection,
finished when the connection is over.

HTTP requests are framed by ``Content-Length`` (a chunked body stops the framing for
the rest of that connection). A client never sends a request before the previous
answer on its connection is in, so the bytes held are that request's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from loopback import LoopbackServer

from kvtier.testing import Stall

_READ_BYTES = 1 << 16


class _Hold(Stall):
    def __init__(self, method: str | None) -> None:
        super().__init__()
        self.method = method
        self.released = asyncio.Event()


class _Connection:
    def __init__(self) -> None:
        self.hold: _Hold | None = None


class HoldingProxy(LoopbackServer):
    """Relays 127.0.0.1:``port`` to ``upstream``; holds answers on demand."""

    def __init__(self, upstream: tuple[str, int], *, http: bool = False) -> None:
        super().__init__()
        self.upstream = upstream
        self.http = http
        self._armed: _Hold | None = None
        self._holds: list[_Hold] = []

    async def __aexit__(self, *exc_info: object) -> None:
        for hold in self._holds:
            hold.released.set()
        await self._stop(cancel_handlers=False)

    @contextlib.contextmanager
    def hold_next(self, method: str | None = None) -> Iterator[Stall]:
        """Hold the answer to the next request (of ``method``) until the block ends."""
        hold = self._armed = _Hold(method)
        self._holds.append(hold)
        try:
            yield hold
        finally:
            if self._armed is hold:
                self._armed = None
            hold.released.set()

    def _claim(self, connection: _Connection, method: str | None) -> None:
        hold = self._armed
        if hold is None or connection.hold is not None:
            return
        if hold.method is not None and hold.method != method:
            return
        self._armed = None
        connection.hold = hold
        hold.reach()

    async def _handle(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        task = self._serving(to_client)
        connection = _Connection()
        to_server: asyncio.StreamWriter | None = None
        try:
            server, to_server = await asyncio.open_connection(*self.upstream)
            self._writers.add(to_server)
            # Neither raises: each ends when its side is closed, and closes the other's.
            await asyncio.gather(
                self._requests(connection, client, to_server),
                self._answers(connection, server, to_client),
            )
        except OSError:
            pass  # the server refused the connection
        finally:
            for end in (to_client, to_server):
                if end is not None:
                    self._writers.discard(end)
                    end.close()
                    with contextlib.suppress(OSError, asyncio.CancelledError):
                        await end.wait_closed()
            if connection.hold is not None:
                connection.hold.finish()
            self._handlers.discard(task)

    async def _requests(
        self, connection: _Connection, client: asyncio.StreamReader, to_server: asyncio.StreamWriter
    ) -> None:
        try:
            await self._relay(connection, client, to_server)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            # The client is gone (or the proxy closes): so is whatever it waited for.
            if connection.hold is not None:
                connection.hold.give_up()
            to_server.close()

    async def _relay(
        self, connection: _Connection, client: asyncio.StreamReader, to_server: asyncio.StreamWriter
    ) -> None:
        """Pass the client's requests on, claiming a hold for each as it starts: a
        framed HTTP request by its method, anything else by the chunk read. Returns
        when the client closes; a subclass frames another protocol here."""
        framed = self.http
        while True:
            if not framed:
                data = await client.read(_READ_BYTES)
                if not data:
                    return
                self._claim(connection, None)
                to_server.write(data)
                await to_server.drain()
                continue
            try:
                head = await client.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            method, headers = _parse_head(head)
            self._claim(connection, method)
            to_server.write(head)
            if "chunked" in headers.get("transfer-encoding", "").lower():
                framed = False
                continue
            remaining = int(headers.get("content-length", "0"))
            while remaining:
                data = await client.read(min(remaining, _READ_BYTES))
                if not data:
                    return
                to_server.write(data)
                remaining -= len(data)
            await to_server.drain()

    async def _answers(
        self, connection: _Connection, server: asyncio.StreamReader, to_client: asyncio.StreamWriter
    ) -> None:
        try:
            while data := await server.read(_READ_BYTES):
                if connection.hold is not None:
                    await connection.hold.released.wait()
                to_client.write(data)
                await to_client.drain()
        except OSError:
            pass
        finally:
            to_client.close()


def _parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(":") for line in lines[1:] if line)
    }
    return lines[0].split(" ", 1)[0], headers
