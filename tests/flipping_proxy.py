"""A TCP relay on loopback between a p2p reader and an owner that damages chunks.

The reader dials the relay, which dials the owner and passes bytes both ways. The
owner's side is read frame by frame (the p2p frames travel in the clear without TLS):
while :attr:`FlippingProxy.flips` is above zero, or always with ``always``, the last
byte of each CHUNK frame's payload is flipped on its way to the reader, a fault of the
link that the owner's copy never had. Everything else passes unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib

from loopback import LoopbackServer

from kvtier.tiers.p2p.wire import FRAME, Kind, parse_frame_header

_READ_BYTES = 1 << 16


class FlippingProxy(LoopbackServer):
    """Relays 127.0.0.1:``port`` to ``upstream``; flips a byte of chunks on demand."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self.upstream = upstream
        #: Chunks still to damage; the count goes down by one for each.
        self.flips = 0
        #: Damage every chunk, whatever ``flips`` says.
        self.always = False
        #: Chunks damaged so far.
        self.flipped = 0

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stop(cancel_handlers=True)

    def _take_flip(self) -> bool:
        if self.always:
            return True
        if self.flips > 0:
            self.flips -= 1
            return True
        return False

    async def _handle(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        task = self._serving(to_client)
        to_server: asyncio.StreamWriter | None = None
        try:
            server, to_server = await asyncio.open_connection(*self.upstream)
            self._writers.add(to_server)
            await asyncio.gather(
                _pass(client, to_server), self._frames(server, to_client), return_exceptions=True
            )
        except OSError:
            pass  # the owner refused the connection
        finally:
            for end in (to_client, to_server):
                if end is not None:
                    self._writers.discard(end)
                    end.close()
                    with contextlib.suppress(OSError, asyncio.CancelledError):
                        await end.wait_closed()
            self._handlers.discard(task)

    async def _frames(self, server: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await server.readexactly(FRAME.size)
                kind, length = parse_frame_header(header)
                to_client.write(header)
                if kind is Kind.CHUNK and length and self._take_flip():
                    body = bytearray(await server.readexactly(length))
                    body[-1] ^= 0x01
                    self.flipped += 1
                    to_client.write(body)
                else:
                    remaining = length
                    while remaining:
                        data = await server.read(min(remaining, _READ_BYTES))
                        if not data:
                            return
                        to_client.write(data)
                        remaining -= len(data)
                await to_client.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            to_client.close()


async def _pass(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(_READ_BYTES):
            sink.write(data)
            await sink.drain()
    except OSError:
        pass
    finally:
        sink.close()
