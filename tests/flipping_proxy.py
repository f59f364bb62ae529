"""A TCP relay on loopback between a p2p reader and an owner that damages chunks.

The reader dials the relay, which dials the owner and passes bytes both ways. The
owner's side is read frame by frame (the p2p frames travel in the clear without TLS):
while :attr:`FlippingProxy.flips` is above zero, or always with ``always``, the last
byte of each CHUNK frame's payload is flipped on its way to the reader, a fault of the
link that the owner's copy never had. Everything else passes unchanged.
"""

from __future__ import annotations

import asyncio

from holding_proxy import HoldingProxy, _Connection

from kvtier.tiers.p2p.wire import FRAME, Kind, parse_frame_header

_READ_BYTES = 1 << 16


class FlippingProxy(HoldingProxy):
    """Relays 127.0.0.1:``port`` to ``upstream``; flips a byte of chunks on demand
    (the owner's side read frame by frame, the reader's passed on as it comes)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__(upstream)
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

    async def _answers(
        self, connection: _Connection, server: asyncio.StreamReader, to_client: asyncio.StreamWriter
    ) -> None:
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
