"""A real Mooncake master on loopback for the mooncake tier's tests.

:class:`MooncakeMaster` runs ``mooncake_master`` in its own process with its HTTP
metadata server, every port a free one on 127.0.0.1, stopped by its pid; it can be
killed and started again on the same ports, as a master that crashes and comes back.
:func:`mooncake_tier` is a tier mapping for it with segments of a few MiB.

Importing this module points Mooncake's transfer engine at 127.0.0.1
(``MC_TCP_BIND_ADDRESS``; left alone, it listens on the first active interface and
the nodes would send each other chunks there), for this process and the engine
processes it spawns. The master's metadata server binds every interface whatever its
host flag says; tests only ever address 127.0.0.1.

A test that builds a master is skipped where Mooncake's client or its master cannot
load (not installed, or without libibverbs).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from server_process import ServerProcess

from kvtier.bench.servers import free_port

__all__ = ["SEGMENT_BYTES", "MooncakeMaster", "RawStore", "mooncake_tier", "require_mooncake"]

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

# What each test node lends the pool: a few dozen chunks of the tests' sizes.
SEGMENT_BYTES = 32 << 20
# The test's own client stages whole objects (a header and a chunk of a few MiB).
RAW_BUFFER_BYTES = 16 << 20


def require_mooncake() -> str:
    """The ``mooncake_master`` executable; skips the calling test where Mooncake's
    client cannot be imported or no master is installed."""
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:
        pytest.skip(
            f"Mooncake's client cannot load ({exc}): pip install '.[mooncake]' "
            "(Debian also needs libibverbs1)"
        )
    beside = Path(sys.executable).parent / "mooncake_master"
    binary = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if binary is None:
        pytest.skip("mooncake_master is not installed: pip install '.[mooncake]'")
    return binary


class MooncakeMaster(ServerProcess):
    """``mooncake_master`` with its metadata server on 127.0.0.1, while the context lasts."""

    name = "mooncake_master"

    def __init__(self) -> None:
        super().__init__()
        self.binary = require_mooncake()
        self.port = free_port()
        self.metadata_port = free_port()
        self.metrics_port = free_port()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def _ports(self) -> list[int]:
        # Ready once its RPC service and its metadata server accept connections.
        return [self.port, self.metadata_port]

    def _command(self) -> list[str]:
        return [
            self.binary,
            "-rpc_address=127.0.0.1",
            f"-rpc_port={self.port}",
            "-enable_http_metadata_server=true",
            "-http_metadata_server_host=127.0.0.1",
            f"-http_metadata_server_port={self.metadata_port}",
            "-metrics_host=127.0.0.1",
            f"-metrics_port={self.metrics_port}",
            "-enable_metric_reporting=false",
            "-logtostderr",
        ]


def mooncake_tier(master: MooncakeMaster, **params: Any) -> dict[str, Any]:
    """A mooncake tier mapping for ``master``, this node lending ``SEGMENT_BYTES``."""
    tier: dict[str, Any] = {
        "type": "mooncake",
        "master_server_address": master.address,
        "metadata_server": master.metadata_server,
        "local_hostname": "127.0.0.1",
        "protocol": "tcp",
        "global_segment_size": SEGMENT_BYTES,
        "local_buffer_size": 4 << 20,
    }
    tier.update(params)
    return tier


class RawStore:
    """A Mooncake client of the test's own, lending nothing: reads and writes objects
    past any tier (to read what a tier stored, to plant damaged bytes)."""

    def __init__(self, master: MooncakeMaster) -> None:
        self.master = master
        self._client: Any = None

    async def __aenter__(self) -> RawStore:
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        code = await asyncio.to_thread(
            client.setup,
            "127.0.0.1",
            self.master.metadata_server,
            0,
            RAW_BUFFER_BYTES,
            "tcp",
            "",
            self.master.address,
        )
        assert code == 0, f"the test's Mooncake client failed to set up: {code}"
        self._client = client
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        client, self._client = self._client, None
        if client is not None:
            await asyncio.to_thread(client.close)

    async def read(self, name: str) -> bytes | None:
        """The object ``name``'s bytes, or None when the store holds none."""
        exists = await asyncio.to_thread(self._client.is_exist, name)
        if exists != 1:
            return None
        data: bytes = await asyncio.to_thread(self._client.get, name)
        return data or None

    async def write(self, name: str, data: bytes) -> None:
        """Store ``data`` as object ``name``, replacing what is there."""
        await asyncio.to_thread(self._client.remove, name, True)
        code = await asyncio.to_thread(self._client.put, name, data)
        assert code == 0, f"Mooncake refused to store {name}: {code}"
