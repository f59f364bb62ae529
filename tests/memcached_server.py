"""Real memcached on loopback for the memcached tier's tests.

- :class:`MemcachedServer`: the ``memcached`` binary in its own process, listening on
  127.0.0.1 only, started on a free port and stopped by its pid; it can be killed and
  started again on the same port, as a server that crashes and comes back. With
  ``credentials`` it asks for memcached's ASCII authentication (``-Y``), which is what
  the tier speaks. :meth:`~MemcachedServer.read_item` and
  :meth:`~MemcachedServer.write_item` reach its items with plain ``get`` and ``set``,
  past any tier (to read what the tier stored, to plant damaged bytes).
- :class:`MemcachedProxy`: a :class:`~holding_proxy.HoldingProxy` that frames
  memcached's commands, so that ``hold_next("get")`` holds the answer to the next
  ``get`` and to nothing else (a lookup's ``touch`` goes by).

A test that builds a server is skipped where no memcached binary is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator

import anyio
import pytest
from holding_proxy import HoldingProxy, _Connection
from server_process import ServerProcess

from kvtier.bench.servers import free_port

__all__ = ["MemcachedProxy", "MemcachedServer", "memcached_binary"]

# memcached's own default item size (-I 1m): the tier's default max_item_bytes.
DEFAULT_ITEM_BYTES = 1 << 20
# A test stores a few MiB at most. memcached refuses an item size above half its memory.
MEMORY_MIB = 32
# An item read or written past the tier is on loopback: anything slower is a hang.
IO_TIMEOUT_S = 10.0
# The commands whose line is followed by a value of the length in their fifth word.
_STORAGE_COMMANDS = frozenset({"set", "add", "replace", "append", "prepend", "cas"})


def memcached_binary() -> str:
    """The memcached executable; skips the calling test where none is installed."""
    binary = shutil.which("memcached")
    if binary is None:
        pytest.skip("memcached is not installed (Debian: apt-get install memcached)")
    return binary


class MemcachedServer(ServerProcess):
    """memcached on 127.0.0.1 in its own process, while the context lasts.

    ``credentials`` ``(user, password)`` makes it ask for them (``-Y``); items hold up
    to ``max_item_bytes`` (``-I``).
    """

    name = "memcached"

    def __init__(
        self,
        *,
        credentials: tuple[str, str] | None = None,
        max_item_bytes: int = DEFAULT_ITEM_BYTES,
    ) -> None:
        super().__init__()
        self.binary = memcached_binary()
        self.credentials = credentials
        self.max_item_bytes = max_item_bytes
        self.port = free_port()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _prepare(self) -> None:
        if self.credentials is not None:
            user, password = self.credentials
            self._path("auth").write_text(f"{user}:{password}\n")

    def _ports(self) -> list[int]:
        return [self.port]

    def _command(self) -> list[str]:
        command = [
            self.binary,
            "-l",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "0",  # no UDP port
            "-m",
            str(MEMORY_MIB),
            "-I",
            str(self.max_item_bytes),
        ]
        if os.geteuid() == 0:
            # memcached refuses to run as root without -u; CI's tests run as root.
            command += ["-u", "root"]
        if self.credentials is not None:
            command += ["-Y", str(self._path("auth"))]
        return command

    async def read_item(self, name: str) -> bytes | None:
        """The value of item ``name`` (``get``), or None when the server holds none."""
        async with self._connection() as (reader, writer):
            writer.write(f"get {name}\r\n".encode())
            line = await reader.readuntil(b"\r\n")
            if line == b"END\r\n":
                return None
            size = int(line.split()[3])
            value = await reader.readexactly(size + 2)
            assert await reader.readuntil(b"\r\n") == b"END\r\n"
            return value[:-2]

    async def write_item(self, name: str, value: bytes) -> None:
        """Store ``value`` as item ``name`` (``set``, replacing what is there)."""
        async with self._connection() as (reader, writer):
            writer.write(b"set %s 0 0 %d\r\n%s\r\n" % (name.encode(), len(value), value))
            answer = await reader.readuntil(b"\r\n")
            assert answer == b"STORED\r\n", f"memcached answered {answer!r} to a set"

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        with anyio.fail_after(IO_TIMEOUT_S):
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            try:
                if self.credentials is not None:
                    credentials = " ".join(self.credentials).encode()
                    writer.write(b"set auth 0 0 %d\r\n%s\r\n" % (len(credentials), credentials))
                    assert await reader.readuntil(b"\r\n") == b"STORED\r\n"
                yield reader, writer
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()


class MemcachedProxy(HoldingProxy):
    """Relays 127.0.0.1:``port`` to a memcached server, a command at a time:
    ``hold_next("get")`` holds the answer to the next ``get`` only."""

    async def _relay(
        self, connection: _Connection, client: asyncio.StreamReader, to_server: asyncio.StreamWriter
    ) -> None:
        while True:
            try:
                line = await client.readuntil(b"\r\n")
            except asyncio.IncompleteReadError:
                return
            words = line.split()
            command = words[0].decode("latin-1") if words else ""
            self._claim(connection, command)
            to_server.write(line)
            if command in _STORAGE_COMMANDS:
                to_server.write(await client.readexactly(int(words[4]) + 2))
            await to_server.drain()
