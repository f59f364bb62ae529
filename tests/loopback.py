"""A TCP server on loopback for test relays and proxies: its port, and a close that
ends every connection it is serving."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

_S = TypeVar("_S", bound="LoopbackServer")


class LoopbackServer:
    """Serves 127.0.0.1 on a free port with :meth:`_handle`, one task a connection.

    A handler registers its connection with :meth:`_serving` (more writers it opens go
    into ``_writers``); :meth:`_stop` closes the listener and those connections, and waits
    for their handlers.
    """

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self: _S) -> _S:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _handle(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def _serving(self, writer: asyncio.StreamWriter) -> asyncio.Task[Any]:
        """The calling handler serves the connection of ``writer``: close ends both.
        Returns the handler's task (it discards itself when it ends)."""
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.add(writer)
        return task

    async def _stop(self, *, cancel_handlers: bool) -> None:
        """Close the listener and every connection; wait for the handlers (cancelled
        first with ``cancel_handlers``)."""
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        if cancel_handlers:
            for task in list(self._handlers):
                task.cancel()
        if self._handlers:
            await asyncio.wait(list(self._handlers))
        await self._server.wait_closed()
