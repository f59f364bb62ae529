"""A memcached server on loopback for the memcached tier's tests.

It speaks the part of memcached's text protocol the tier uses (``version``, ``add``,
``set``, ``get``, ``touch``, ``delete``, and ASCII authentication as ``memcached -Y``
does), keeps its items in a dictionary the tests can read and damage, and can hold the
answer to the next command of a kind (:meth:`MemcachedServer.hold_next`), as a
:class:`~kvtier.testing.Stall`. Real memcached is not installed here; the tier only
needs what the protocol says, which this server follows.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from loopback import LoopbackServer

from kvtier.testing import Stall

# memcached's default item size (-I 1m).
DEFAULT_ITEM_BYTES = 1 << 20


class _Hold(Stall):
    def __init__(self, command: bytes) -> None:
        super().__init__()
        self.command = command
        self.released = asyncio.Event()


class MemcachedServer(LoopbackServer):
    """Items by name; ``credentials`` ``(user, password)`` asks for authentication."""

    def __init__(
        self,
        *,
        credentials: tuple[str, str] | None = None,
        max_item_bytes: int = DEFAULT_ITEM_BYTES,
    ) -> None:
        super().__init__()
        self.items: dict[bytes, bytes] = {}
        self.credentials = credentials
        self.max_item_bytes = max_item_bytes
        self.commands: list[bytes] = []
        self._armed: _Hold | None = None
        self._holds: list[_Hold] = []

    async def __aexit__(self, *exc_info: object) -> None:
        for hold in self._holds:
            hold.released.set()
        await self._stop(cancel_handlers=True)

    @contextlib.contextmanager
    def hold_next(self, command: bytes) -> Iterator[Stall]:
        """Hold the answer to the next ``command`` (``b"get"``, ``b"add"``) until the
        block ends; the command itself is carried out first."""
        hold = self._armed = _Hold(command)
        self._holds.append(hold)
        try:
            yield hold
        finally:
            if self._armed is hold:
                self._armed = None
            hold.released.set()

    async def _handle(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        self._serving(to_client)
        authenticated = self.credentials is None
        try:
            while line := await client.readline():
                words = line.split()
                if not words:
                    continue
                verb = words[0]
                self.commands.append(verb)
                if verb in (b"add", b"set"):
                    value = await client.readexactly(int(words[4]) + 2)
                    answer = self._store(words, value[:-2], authenticated)
                    if answer == b"AUTHENTICATED":
                        authenticated, answer = True, b"STORED\r\n"
                elif not authenticated:
                    answer = b"CLIENT_ERROR unauthenticated\r\n"
                elif verb == b"version":
                    answer = b"VERSION 1.6.0-kvtier-test\r\n"
                elif verb == b"get":
                    value = self.items.get(words[1])
                    answer = b"END\r\n"
                    if value is not None:
                        head = b"VALUE %s 0 %d\r\n" % (words[1], len(value))
                        answer = head + value + b"\r\nEND\r\n"
                elif verb == b"touch":
                    answer = b"TOUCHED\r\n" if words[1] in self.items else b"NOT_FOUND\r\n"
                elif verb == b"delete":
                    found = self.items.pop(words[1], None) is not None
                    answer = b"DELETED\r\n" if found else b"NOT_FOUND\r\n"
                else:
                    answer = b"ERROR\r\n"
                held = await self._hold(verb, client)
                to_client.write(answer)
                await to_client.drain()
                if held is not None:
                    held.finish()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            to_client.close()

    def _store(self, words: list[bytes], value: bytes, authenticated: bool) -> bytes:
        if not authenticated:
            user, _, password = value.decode().partition(" ")
            if (user, password) == self.credentials:
                return b"AUTHENTICATED"
            return b"CLIENT_ERROR authentication failure\r\n"
        if len(value) > self.max_item_bytes:
            return b"SERVER_ERROR object too large for cache\r\n"
        name = words[1]
        if words[0] == b"add" and name in self.items:
            return b"NOT_STORED\r\n"
        self.items[name] = value
        return b"STORED\r\n"

    async def _hold(self, verb: bytes, client: asyncio.StreamReader) -> _Hold | None:
        """Hold the answer to ``verb`` if a hold is armed for it; the hold, released."""
        hold = self._armed
        if hold is None or hold.command != verb:
            return None
        self._armed = None
        hold.reach()
        # The tier sends nothing more on this connection before its answer: what it
        # reads now is the end of the connection, once the tier has let go.
        gone = asyncio.ensure_future(client.read(1))
        released = asyncio.ensure_future(hold.released.wait())
        try:
            await asyncio.wait([gone, released], return_when=asyncio.FIRST_COMPLETED)
        finally:
            released.cancel()
        if gone.done():
            hold.give_up()
            raise ConnectionError("the client let go")
        gone.cancel()
        return hold
