"""S3-speaking servers on loopback for the s3 tier's tests and benchmark.

- :class:`MotoServer`: moto's threaded server (in this process), for contract tests;
- :class:`RcloneS3Server`: ``rclone serve s3`` over a local directory (a real server
  binary in its own process), for integration and outage tests;
- :class:`SeaweedS3Server`: SeaweedFS's S3 gateway over its own master, volume server
  and filer (the S3 server of SGLang's and LMCache's SeaweedFS backends), for the
  contract, integration and outage tests;
- :class:`ChaosProxy`: a TCP proxy in front of either that answers 503 SlowDown or
  stops answering on demand, to exercise retries and time-outs against real traffic;
- :class:`TlsProxy`: TLS in front of either, with a certificate of a private authority.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

from aiobotocore.config import AioConfig
from loopback import LoopbackServer

from kvtier.bench.servers import (
    ACCESS_KEY,
    REGION,
    SECRET_KEY,
    START_TIMEOUT_S,
    RcloneS3Server,
    SeaweedS3Server,
    free_port,
    rclone_binary,
    s3_client,
    wait_listening,
    weed_binary,
)

__all__ = [
    "ACCESS_KEY",
    "REGION",
    "SECRET_KEY",
    "ChaosProxy",
    "MotoServer",
    "RcloneS3Server",
    "S3Server",
    "SeaweedS3Server",
    "TlsProxy",
    "free_port",
    "fresh_bucket",
    "put_object",
    "raw_client",
    "rclone_binary",
    "read_object",
    "weed_binary",
]


class S3Server(Protocol):
    """What the tests use of a server: where it listens."""

    port: int

    @property
    def endpoint(self) -> str: ...


class MotoServer:
    """moto's S3 server on 127.0.0.1 (in a thread of this process)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._server.start()
        wait_listening(self.port, START_TIMEOUT_S)

    def stop(self) -> None:
        self._server.stop()


@contextlib.contextmanager
def fresh_bucket(endpoint: str) -> Iterator[str]:
    """A new, empty bucket on the server at ``endpoint``, deleted with its objects after.

    Deleting matters on SeaweedFS, where each bucket holds volumes of its own.
    """
    import boto3

    name = f"kvtier-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )
    try:
        client.create_bucket(Bucket=name)
        yield name
        # Best effort: a test may have left the server down.
        with contextlib.suppress(Exception):
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
                for item in page.get("Contents", ()):
                    client.delete_object(Bucket=name, Key=item["Key"])
            client.delete_bucket(Bucket=name)
    finally:
        client.close()


@contextlib.asynccontextmanager
async def raw_client(endpoint: str, **config: Any) -> AsyncIterator[Any]:
    """A plain aiobotocore S3 client for ``endpoint`` (to inspect or damage objects)."""
    settings: dict[str, Any] = {
        "s3": {"addressing_style": "path"},
        "request_checksum_calculation": "when_required",
        "response_checksum_validation": "when_required",
        "retries": {"total_max_attempts": 1, "mode": "standard"},
    }
    settings.update(config)
    async with s3_client(endpoint, AioConfig(**settings)) as client:
        yield client


async def read_object(endpoint: str, bucket: str, name: str) -> bytes | None:
    """The bytes of object ``name``, or None when there is none."""
    async with raw_client(endpoint) as client:
        try:
            response = await client.get_object(Bucket=bucket, Key=name)
        except client.exceptions.NoSuchKey:
            return None
        async with response["Body"] as body:
            return bytes(await body.read())


async def put_object(endpoint: str, bucket: str, name: str, data: bytes) -> None:
    """Store ``data`` as object ``name``, past any tier (to plant or damage objects)."""
    async with raw_client(endpoint) as client:
        await client.put_object(Bucket=bucket, Key=name, Body=data)


class ChaosProxy(LoopbackServer):
    """A TCP proxy on 127.0.0.1 in front of an S3 server, misbehaving on demand.

    Each new connection's first request decides its fate: while :attr:`refuse` is
    positive it is answered ``503 SlowDown`` (and the connection closed); while
    :attr:`stall` is set it is never answered; with :attr:`no_conditional_writes`, a
    request carrying ``If-None-Match`` is answered ``501 NotImplemented``, as by a
    server without conditional writes; otherwise the connection is piped to the server
    from then on. :meth:`drop_connections` closes every open connection, so a client's
    pooled connections meet the new behaviour.
    """

    def __init__(self, upstream_port: int) -> None:
        super().__init__()
        self.upstream_port = upstream_port
        self.refuse = 0
        self.refused = 0
        self.stall = False
        self.no_conditional_writes = False

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stop(cancel_handlers=True)

    async def drop_connections(self) -> None:
        """Close every open connection, and give clients a moment to notice."""
        self._close_all()
        handlers = [task for task in self._handlers if task is not asyncio.current_task()]
        if handlers:
            await asyncio.wait(handlers, timeout=5)
        # The clients run on this loop: let them see the connections go.
        await asyncio.sleep(0.05)

    def _close_all(self) -> None:
        for writer in list(self._writers):
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = self._serving(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, headers = _parse_head(head)
            if self.stall:
                while await reader.read(1 << 16):
                    pass
            elif self.refuse > 0:
                self.refuse -= 1
                self.refused += 1
                await _answer(reader, writer, method, headers, "503 Slow Down", "SlowDown")
            elif self.no_conditional_writes and "if-none-match" in headers:
                await _answer(
                    reader, writer, method, headers, "501 Not Implemented", "NotImplemented"
                )
            else:
                up_reader, upstream = await asyncio.open_connection("127.0.0.1", self.upstream_port)
                self._writers.add(upstream)
                upstream.write(head)
                await asyncio.gather(_pipe(reader, upstream), _pipe(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            for end in (writer, upstream):
                if end is not None:
                    self._writers.discard(end)
                    end.close()
                    with contextlib.suppress(OSError, asyncio.CancelledError):
                        await end.wait_closed()
            self._handlers.discard(task)


def _parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(":") for line in lines[1:] if line)
    }
    return lines[0].split(" ", 1)[0], headers


async def _answer(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    method: str,
    headers: dict[str, str],
    status: str,
    code: str,
) -> None:
    """Answer a request with an S3 error document and close the connection."""
    # A client that sent a body without waiting for "100 Continue" must see it
    # consumed, or closing the socket would reset the connection under the reply.
    if headers.get("expect", "").lower() != "100-continue":
        await reader.readexactly(int(headers.get("content-length", "0")))
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        "<Message>Injected by the test proxy.</Message></Error>"
    ).encode()
    writer.write(
        f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n".encode()
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + (b"" if method == "HEAD" else body)
    )
    await writer.drain()


class TlsProxy(LoopbackServer):
    """An https endpoint on loopback in front of an S3 server on ``upstream_port``, its
    certificate (for 127.0.0.1) signed by ``ca`` (a ``trustme.CA``): a server whose
    authority only a ``ca_bundle`` makes trusted."""

    def __init__(self, upstream_port: int, ca: Any) -> None:
        super().__init__()
        self.upstream_port = upstream_port
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(self._context)

    @property
    def endpoint(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def __aenter__(self) -> TlsProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self._context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stop(cancel_handlers=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = self._serving(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            up_reader, upstream = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            self._writers.add(upstream)
            await asyncio.gather(_pipe(reader, upstream), _pipe(up_reader, writer))
        except OSError:
            pass
        finally:
            for end in (writer, upstream):
                if end is not None:
                    self._writers.discard(end)
                    end.close()
                    with contextlib.suppress(OSError, asyncio.CancelledError):
                        await end.wait_closed()
            self._handlers.discard(task)


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(1 << 16):
            sink.write(data)
            await sink.drain()
    finally:
        sink.close()
