"""The mooncake tier: chunks as objects of a Mooncake Store, a pool of DRAM that the
nodes of a cluster lend to each other, run by one master.

Every node's tier is a Mooncake client that lends the pool a segment of its own memory
(``global_segment_size``, 0: it lends none) and asks the master where each object
lives; the bytes then move between the nodes directly (TCP, or RDMA where the client
was built for it). The master knows nothing of kvtier: an object is a chunk's header
(:mod:`kvtier.format`, with the key, the namespace and both checksums) followed by its
primary row, named ``<model>_<namespace digest>/<key hex>`` as the memcached tier
names its items, so engines of one model share what they store and never see another
model's.

The data path copies nothing on kvtier's side: the primary region (and an arena of
headers, one per slot and direction) is registered with the client at start, a job's
chunks go out in one ``batch_put_from_multi_buffers`` call (header and row as two
buffers of one object) and come back with one ``batch_get_into_multi_buffers``, the
row written by the transfer engine straight into its slot and the header into the
arena, where the I/O thread verifies both before the load reports the chunk. Lookups
are one ``batch_is_exist`` per batch.

Mooncake's client blocks, so every call runs in the tier's own I/O threads
(:func:`kvtier.tiers.kit.in_threads`, as the fs tier's reads and writes do): a job whose call
hangs (a master gone, a node gone) is failed by the framework at its ``job_timeout_s``,
and the slots its thread still holds stay quarantined until the call returns (the
thread keeps the job's rows referenced until then). A node that lent the segment
holding a chunk and went away turns that chunk's load into a failed transfer, which is
a counted miss; one that stops answering fails it once Mooncake's TCP transport sees
no progress for ``tcp_progress_timeout_s`` (the tier's ``job_deadline_s`` unless the
environment says otherwise), well before the framework's time-out. A chunk whose
object has the wrong length or fails verification is counted, removed and never
served.

One case stays open: Mooncake's own clients warn that a transfer its engine timed out
may still move bytes after the call returned (a node stopped past the progress timeout
and resumed wrote nothing late here), and the framework quarantines only the slots of
jobs it timed out itself, not those of a job that returned a failure.

Configuration (the keys of Mooncake's own ``mooncake.json``, which ``config_path`` or
the ``MOONCAKE_CONFIG_PATH`` environment variable may name instead)::

    {"type": "mooncake", "master_server_address": "10.0.0.9:50051",
     "metadata_server": "http://10.0.0.9:8080/metadata", "local_hostname": "10.0.0.5",
     "protocol": "tcp", "global_segment_size": 4294967296}
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.to_thread

from kvtier.errors import KVTierError
from kvtier.format import HEADER_BYTES, ChunkFormat, namespace_directory
from kvtier.keys import OffloadKey
from kvtier.metrics import MetricDefinition, tier_io_metric_definitions
from kvtier.records import Locality, Medium, OffloadingEvent
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob
from kvtier.tiers.kit import (
    ConfigError,
    ConfigReader,
    CorruptChunks,
    DepthRange,
    EventLog,
    IoDepth,
    ThrottledLog,
    depth_gauge,
    derived_field,
    describe_error,
    in_threads,
    job_deadline_s,
    parse_address,
)

__all__ = [
    "CONFIG_PATH_VARIABLE",
    "PROGRESS_TIMEOUT_VARIABLE",
    "MooncakeError",
    "MooncakeSettings",
    "MooncakeTier",
    "error_name",
]

logger = logging.getLogger(__name__)

#: The environment variable Mooncake's own integrations read a ``mooncake.json`` from.
CONFIG_PATH_VARIABLE = "MOONCAKE_CONFIG_PATH"
#: The environment variable of Mooncake's TCP transport that says how many seconds a
#: transfer may make no progress before it fails (30 by default: a node that stopped
#: answering held a load that long here).
PROGRESS_TIMEOUT_VARIABLE = "MC_TCP_PROGRESS_TIMEOUT_SEC"

MIB = 1 << 20
# mooncake_master's own default RPC port, and the port of the metadata server it runs
# with -enable_http_metadata_server (-http_metadata_server_port's default).
DEFAULT_MASTER = "127.0.0.1:50051"
DEFAULT_METADATA_SERVER = "http://127.0.0.1:8080/metadata"
# The memory a node lends the pool. Mooncake's examples lend gigabytes; a default that
# large would surprise a node that only meant to read, and one far smaller holds few
# chunks: 1 GiB is 256 chunks of 4 MiB.
DEFAULT_GLOBAL_SEGMENT_SIZE = 1 << 30
# The client's staging buffer for calls that do not name registered memory. kvtier's
# transfers all do; the client's own default (16 MiB) costs little and keeps its
# other calls working.
DEFAULT_LOCAL_BUFFER_SIZE = 16 * MIB
# Jobs in flight per direction, each one batch call: the transfer engine moves a
# batch's objects in parallel itself, so a few calls keep a link busy.
DEFAULT_IO_THREADS = 4
# A master or metadata server on the LAN accepts in milliseconds. Checked before the
# client's setup because that, with no master answering, retries for about 90 s.
DEFAULT_CONNECT_TIMEOUT_S = 2.0
# How long the client's setup may take once the servers answer: measured at 0.05-0.1 s
# on loopback; mapping and registering a large segment takes longer.
SETUP_TIMEOUT_S = 60.0
# How long closing waits for calls still in flight before it leaves the client open
# (closing it under a running call would free memory that call uses).
CLOSE_WAIT_S = 30.0

PROTOCOLS = ("tcp", "rdma")
# The client refuses to lend a segment smaller than this ("Total size must be at least
# 16777216"), failing its setup.
MIN_SEGMENT_BYTES = 16 * MIB

# Mooncake Store's error codes (its ErrorCode enum, mooncake-store/include/types.h).
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800
RPC_FAIL = -900
_ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE (the pool has no room)",
    INVALID_PARAMS: "INVALID_PARAMS",
    REPLICA_IS_NOT_READY: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
}
# What a load found for a chunk besides a problem ChunkFormat.verify names.
_MISSING = "missing"
_FAILED = "failed"


def error_name(code: int) -> str:
    """Mooncake's name for a negative return ``code`` (``-800``: ``TRANSFER_FAIL``)."""
    name = _ERROR_NAMES.get(code)
    return f"{name} ({code})" if name else f"error {code}"


class MooncakeError(KVTierError):
    """Mooncake Store refused or failed an operation."""


@dataclass(frozen=True)
class MooncakeSettings:
    """The mooncake tier's parameters, named as in Mooncake's ``mooncake.json``.

    The keys that file shares with the tier (``master_server_address`` to
    ``local_buffer_size``) are None until :meth:`for_engine` fills them in: from the
    tier's own parameters first, then from the ``mooncake.json`` that ``config_path``
    names, then from the defaults listed here.
    """

    #: ``"host:port"`` of ``mooncake_master``'s RPC service (``"127.0.0.1:50051"``).
    master_server_address: str | None = None
    #: Where the nodes publish their segments: the master's HTTP metadata server
    #: (``"http://host:8080/metadata"``, the default on 127.0.0.1), ``etcd://...``,
    #: ``redis://...`` or ``P2PHANDSHAKE``.
    metadata_server: str | None = None
    #: The address other nodes reach this one at (its LAN address, never 127.0.0.1 in a
    #: cluster). Default: this machine's host name.
    local_hostname: str | None = None
    #: ``"tcp"`` (the default) or ``"rdma"``.
    protocol: str | None = None
    #: The RDMA devices to use (``"mlx5_0,mlx5_1"``); ``""`` (the default): all of them,
    #: or none over TCP.
    device_name: str | None = None
    #: Bytes of this node's memory lent to the pool (1 GiB); 0: it lends none and only
    #: reads and writes other nodes' segments.
    global_segment_size: int | None = None
    #: Bytes of the client's own staging buffer (16 MiB; kvtier's transfers bypass it).
    local_buffer_size: int | None = None
    #: A ``mooncake.json`` whose keys fill in those not given here; None (the default):
    #: the file the ``MOONCAKE_CONFIG_PATH`` environment variable names, if set. Read
    #: when the tier is built (and by ``kvtier plan``), never when the configuration is
    #: only checked.
    config_path: str | None = None
    #: Jobs in flight at once, each way (4), each one batch call in its own thread.
    io_threads: int = DEFAULT_IO_THREADS
    #: Seconds to reach the master and the metadata server at start (2).
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    #: Seconds a lookup may take before it fails. None (the default): two thirds of the
    #: tier's ``job_timeout_s``; it must stay below it.
    job_deadline_s: float | None = None
    #: The size of a chunk's object (header + primary row). Not a parameter: derived
    #: from the engine's chunk size.
    object_bytes: int | None = derived_field()
    #: Seconds Mooncake's TCP transport lets a transfer make no progress before it
    #: fails it: ``MC_TCP_PROGRESS_TIMEOUT_SEC`` where the environment sets it, else
    #: ``job_deadline_s`` (whole seconds, at least 1), which the tier puts in the
    #: environment before its client starts, so that a node that stops answering is a
    #: miss within the deadline. Not a parameter.
    tcp_progress_timeout_s: int | None = derived_field()

    @classmethod
    def from_params(cls, params: Mapping[str, Any], path: str) -> MooncakeSettings:
        """Read the tier's parameters; errors name ``path.<parameter>``. Opens nothing."""
        reader = ConfigReader(params, path)
        config_path: str | None = reader.string("config_path", None)
        if config_path is None:
            config_path = os.environ.get(CONFIG_PATH_VARIABLE) or None
        settings = cls(
            **_read_shared(reader),
            config_path=config_path,
            io_threads=reader.integer("io_threads", DEFAULT_IO_THREADS, minimum=1, maximum=64),
            connect_timeout_s=reader.number(
                "connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S, minimum=0, exclusive_minimum=True
            ),
            job_deadline_s=reader.number("job_deadline_s", None, minimum=0, exclusive_minimum=True),
        )
        reader.reject_unknown()
        return settings

    def for_engine(self, *, chunk_bytes: int, job_timeout_s: float, path: str) -> MooncakeSettings:
        """These settings for an engine's chunks and job time-out: the object size and
        the deadline derived, the shared keys filled in (reading ``config_path``).

        Raises:
            ConfigError: ``job_deadline_s`` is not below ``job_timeout_s``, or the
                ``mooncake.json`` cannot be read or holds a bad value (named by the
                file and its key).
        """
        deadline = job_deadline_s(job_timeout_s, self.job_deadline_s, f"{path}.job_deadline_s")
        from_file = {} if self.config_path is None else _from_file(self.config_path, path)
        defaults: dict[str, Any] = {**_DEFAULTS, "local_hostname": socket.gethostname()}
        shared = {
            key: value
            if (value := getattr(self, key)) is not None
            else from_file.get(key, defaults[key])
            for key in _DEFAULTS
        }
        return replace(
            self,
            **shared,
            object_bytes=HEADER_BYTES + chunk_bytes,
            job_deadline_s=deadline,
            tcp_progress_timeout_s=_progress_timeout(deadline, path),
        )


# The keys a mooncake.json shares with the tier's parameters, and their defaults (the
# local host name is this machine's).
_DEFAULTS: dict[str, Any] = {
    "master_server_address": DEFAULT_MASTER,
    "metadata_server": DEFAULT_METADATA_SERVER,
    "local_hostname": None,
    "protocol": "tcp",
    "device_name": "",
    "global_segment_size": DEFAULT_GLOBAL_SEGMENT_SIZE,
    "local_buffer_size": DEFAULT_LOCAL_BUFFER_SIZE,
}


def _progress_timeout(deadline: float, path: str) -> int:
    """The TCP progress timeout the client will run with (see the settings' field)."""
    given = os.environ.get(PROGRESS_TIMEOUT_VARIABLE)
    if given is None:
        return max(1, int(deadline))
    if not given.strip().isdigit() or int(given) < 1:
        raise ConfigError(
            f"{path} (environment)",
            f"{PROGRESS_TIMEOUT_VARIABLE} must be a whole number of seconds, got {given!r}",
        )
    return int(given)


def _read_shared(reader: ConfigReader) -> dict[str, Any]:
    """The shared keys ``reader``'s mapping gives, checked."""
    values: dict[str, Any] = {}
    master = reader.string("master_server_address", None)
    if master is not None:
        parse_address(master, reader.path_of("master_server_address"))
        values["master_server_address"] = master
    metadata = reader.string("metadata_server", None)
    if metadata is not None:
        _metadata_server(metadata, reader.path_of("metadata_server"))
        values["metadata_server"] = metadata
    device_name = reader.raw("device_name", None)
    if device_name is not None:
        if not isinstance(device_name, str):
            raise ConfigError(reader.path_of("device_name"), 'expected a string ("": all devices)')
        values["device_name"] = device_name
    read = {
        "local_hostname": reader.string("local_hostname", None),
        "protocol": reader.string("protocol", None, choices=PROTOCOLS),
        "global_segment_size": reader.integer("global_segment_size", None, minimum=0),
        "local_buffer_size": reader.integer("local_buffer_size", None, minimum=0),
    }
    values.update((key, value) for key, value in read.items() if value is not None)
    segment = values.get("global_segment_size", 0)
    if 0 < segment < MIN_SEGMENT_BYTES:
        raise ConfigError(
            reader.path_of("global_segment_size"),
            f"Mooncake lends segments of at least {MIN_SEGMENT_BYTES} bytes (16 MiB), or 0 "
            f"to lend none; got {segment}",
        )
    return values


def _from_file(config_path: str, path: str) -> dict[str, Any]:
    """The shared keys of the ``mooncake.json`` at ``config_path``, checked; its other
    keys (the master's, the store service's) are not the tier's and are left."""
    where = f"{path}.config_path"
    try:
        with open(config_path, encoding="utf-8") as file:
            # A mooncake.json is a few hundred bytes: a file far longer is not one.
            text = file.read(1 << 20)
        values = json.loads(text)
    except OSError as exc:
        raise ConfigError(where, f"cannot read {config_path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(where, f"{config_path} is not JSON: {exc}") from None
    if not isinstance(values, Mapping):
        raise ConfigError(where, f"{config_path} holds no JSON object")
    shared = {key: values[key] for key in _DEFAULTS if key in values}
    return _read_shared(ConfigReader(shared, f"{where}[{config_path}]"))


def _metadata_server(value: str, path: str) -> tuple[str, int] | None:
    """The HTTP metadata server's address (None for the other kinds, which the client
    checks itself)."""
    if value == "P2PHANDSHAKE":
        return None
    scheme = value.partition("://")[0]
    if scheme not in ("http", "etcd", "redis"):
        raise ConfigError(
            path,
            f"expected http://host:port/metadata, etcd://host:port, redis://host:port or "
            f"P2PHANDSHAKE, got {value!r}",
        )
    if scheme != "http":
        return None
    parts = urlsplit(value)
    if not parts.hostname or parts.port is None:
        raise ConfigError(path, f"expected http://host:port/metadata, got {value!r}")
    return parts.hostname, parts.port


class MooncakeTier(SecondaryTier):
    """Chunks as objects of a Mooncake Store (parameters: :class:`MooncakeSettings`)."""

    medium = Medium.REMOTE_MEMORY
    locality = Locality.REMOTE
    settings_class = MooncakeSettings

    def __init__(self, ctx: TierContext, settings: MooncakeSettings) -> None:
        super().__init__(ctx)
        # Filled in by effective_settings, from which the framework builds the tier.
        assert settings.object_bytes is not None and settings.job_deadline_s is not None
        assert all(getattr(settings, key) is not None for key in _DEFAULTS)
        self.settings = settings
        self._format = ChunkFormat(ctx.namespace)
        self._prefix = namespace_directory(ctx.model_name, self._format)
        self._events = EventLog(ctx.enable_events)
        self._log = ThrottledLog(logger, f"tier {ctx.tier_name}")
        self._corrupt = CorruptChunks(ctx, self._log, self.object_name)
        fixed = DepthRange.fixed(settings.io_threads)
        metrics, name = ctx.metrics, ctx.tier_name
        self._reads = IoDepth(fixed, depth_gauge(metrics, name, "read"), name=f"kvtier-{name}-read")
        self._writes = IoDepth(
            fixed, depth_gauge(metrics, name, "write"), name=f"kvtier-{name}-write"
        )
        self._client: Any = None
        # One header per slot and direction, registered with the client: a slot is in
        # one load at a time, and two stores of one slot write the same header.
        self._headers: mmap.mmap | None = None
        self._headers_address = 0
        self._registered: list[int] = []
        # Calls into the client still running, so that closing never frees it under one.
        self._calls = 0
        self._calls_ended = threading.Condition()

    @classmethod
    def effective_settings(
        cls, settings: Any, *, chunk_bytes: int, job_timeout_s: float, path: str
    ) -> MooncakeSettings:
        given: MooncakeSettings = settings
        return given.for_engine(chunk_bytes=chunk_bytes, job_timeout_s=job_timeout_s, path=path)

    @classmethod
    def build_metric_definitions(cls, settings: Any) -> dict[str, MetricDefinition]:
        return tier_io_metric_definitions()

    def object_name(self, key: OffloadKey) -> str:
        """The name of ``key``'s object in the store."""
        return f"{self._prefix}/{key.hex()}"

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        path = self.ctx.config_path
        try:
            from mooncake.store import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
                MooncakeDistributedStore,
            )
        except ImportError as exc:
            raise ConfigError(
                f"{path}.type",
                f"Mooncake's client cannot be imported ({exc}): pip install "
                "mooncake-transfer-engine-non-cuda (kvtier's extra mooncake), or "
                "mooncake-transfer-engine on a CUDA node",
            ) from None
        await self._check_reachable()
        self._reads.start()
        self._writes.start()
        settings = self.settings
        if settings.protocol == "tcp" and PROGRESS_TIMEOUT_VARIABLE not in os.environ:
            # Read by the client's transport when it sets up; process-wide, so the
            # first mooncake tier of a process decides it for the others.
            os.environ[PROGRESS_TIMEOUT_VARIABLE] = str(settings.tcp_progress_timeout_s)
        client = MooncakeDistributedStore()
        # setup holds the GIL throughout (the loop stood still for its 0.05 s here);
        # the thread at least lets a start that takes too long be given up.
        try:
            with anyio.fail_after(SETUP_TIMEOUT_S):
                code = await anyio.to_thread.run_sync(
                    client.setup,
                    settings.local_hostname,
                    settings.metadata_server,
                    settings.global_segment_size,
                    settings.local_buffer_size,
                    settings.protocol,
                    settings.device_name,
                    settings.master_server_address,
                    abandon_on_cancel=True,
                )
        except TimeoutError:
            raise ConfigError(
                f"{path}.master_server_address",
                f"Mooncake's client did not set up within {SETUP_TIMEOUT_S:g} s",
            ) from None
        if code != 0:
            await anyio.to_thread.run_sync(client.close)  # what it set up before failing
            raise ConfigError(
                f"{path}.master_server_address",
                f"Mooncake's client failed to set up ({error_name(code)}) with master "
                f"{settings.master_server_address} and metadata server "
                f"{settings.metadata_server}",
            )
        self._client = client
        # Registering gigabytes for RDMA pins them page by page: not on the loop.
        await anyio.to_thread.run_sync(self._register_memory)
        logger.info(
            "tier %s: Mooncake Store at %s, lending %d bytes",
            self.ctx.tier_name,
            settings.master_server_address,
            settings.global_segment_size,
        )

    async def _check_reachable(self) -> None:
        """Fail the start fast, naming the setting, when the master or the HTTP
        metadata server does not accept a connection."""
        settings, path = self.settings, self.ctx.config_path
        master, metadata = settings.master_server_address, settings.metadata_server
        assert master is not None and metadata is not None
        checks = [
            ("master_server_address", parse_address(master, "")),
            ("metadata_server", _metadata_server(metadata, "")),
        ]
        for key, address in checks:
            if address is None:
                continue
            host, port = address
            try:
                with anyio.fail_after(settings.connect_timeout_s):
                    stream = await anyio.connect_tcp(host, port)
                await stream.aclose()
            except (OSError, TimeoutError) as exc:
                raise ConfigError(
                    f"{path}.{key}", f"nothing answers at {host}:{port}: {describe_error(exc)}"
                ) from None

    def _register_memory(self) -> None:
        """Register the primary region and the header arena with the client, so that the
        transfer engine moves chunks to and from them directly (RDMA needs it). Runs in
        a thread."""
        view = self.ctx.primary_view
        rows = len(view)
        self._headers = mmap.mmap(-1, max(1, 2 * rows) * HEADER_BYTES)
        self._headers_address = _address_of(memoryview(self._headers))
        areas = [(self._headers_address, len(self._headers))]
        if rows:
            areas.append(view.memory_range())
        for address, size in areas:
            code = self._client.register_buffer(address, size)
            if code != 0:
                raise ConfigError(
                    f"{self.ctx.config_path}.protocol",
                    f"Mooncake's client cannot register {size} bytes of memory "
                    f"({error_name(code)})",
                )
            self._registered.append(address)

    async def aclose(self) -> None:
        self._reads.close()
        self._writes.close()
        with self._calls_ended:  # a call begun from now on finds the tier closed
            client, self._client = self._client, None
        if client is None:
            return
        # Cancelled, the thread still closes the client once no call runs in it.
        await anyio.to_thread.run_sync(self._close_client, client, abandon_on_cancel=True)

    def _close_client(self, client: Any) -> None:
        """Close the client once no call runs in it. Runs in a thread, but ``close``
        holds the GIL while it unmounts the segment (1.7-2 s measured here): the
        process stands still that long."""
        with self._calls_ended:
            idle = self._calls_ended.wait_for(lambda: self._calls == 0, CLOSE_WAIT_S)
        if not idle:
            # Closing would free what the hung call uses: leave it to the process's end.
            self._log.warning(
                "close", "a call into Mooncake's client still runs: the client is left open"
            )
            return
        for address in self._registered:
            client.unregister_buffer(address)
        self._registered.clear()
        client.close()

    @contextlib.contextmanager
    def _call(self) -> Iterator[Any]:
        """The client, counted busy while a thread uses it."""
        with self._calls_ended:
            client = self._client
            if client is None:
                raise MooncakeError("the tier is closed")
            self._calls += 1
        try:
            yield client
        finally:
            with self._calls_ended:
                self._calls -= 1
                self._calls_ended.notify_all()

    # ---------------------------------------------------------------- lookups

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        names = [self.object_name(key) for key in keys]
        # Lookups touch no slot: a call that outlives the deadline is left to end alone.
        with anyio.fail_after(self.settings.job_deadline_s):
            answers = await anyio.to_thread.run_sync(
                self._exist, names, limiter=self._reads.limiter, abandon_on_cancel=True
            )
        failed = [answer for answer in answers if answer < 0]
        if failed:
            raise MooncakeError(
                f"{len(failed)} of {len(names)} lookups failed: {error_name(failed[0])}"
            )
        return [answer == 1 for answer in answers]

    def _exist(self, names: list[str]) -> list[int]:
        with self._call() as client:
            answers: list[int] = client.batch_is_exist(names)
        return answers

    # ----------------------------------------------------------------- stores

    async def store(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        batch = [
            (key, chunk_id, view[chunk_id])
            for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True)
        ]
        if not batch:
            return JobResult(job.job_id, True, transfer_bytes=0)
        item_bytes = len(batch) * self.ctx.chunk_bytes
        [codes] = await in_threads(self._put, [batch], self._writes, item_bytes)
        stored = [key for (key, _, _), code in zip(batch, codes, strict=True) if code == 0]
        self._events.add(stored, self.medium, False, self.ctx.tier_name)
        failed = [code for code in codes if code != 0]
        if failed:
            raise MooncakeError(
                f"{len(failed)} of {len(batch)} chunk(s) not stored, first: {error_name(failed[0])}"
            )
        return JobResult(job.job_id, True, transfer_bytes=len(stored) * self.ctx.chunk_bytes)

    def _put(self, batch: list[tuple[OffloadKey, int, memoryview]]) -> list[int]:
        """Store a job's chunks in one call; Mooncake's code for each (0: stored, or
        already there). Runs in an I/O thread, which holds the rows until it returns."""
        assert self._headers is not None
        headers, base = memoryview(self._headers), self._headers_address
        names, buffers, sizes = [], [], []
        for key, chunk_id, row in batch:
            offset = chunk_id * HEADER_BYTES
            self._format.pack_header(headers[offset : offset + HEADER_BYTES], key, row)
            names.append(self.object_name(key))
            buffers.append([base + offset, _address_of(row)])
            sizes.append([HEADER_BYTES, len(row)])
        with self._call() as client:
            codes: list[int] = client.batch_put_from_multi_buffers(names, buffers, sizes)
        return codes

    # ------------------------------------------------------------------ loads

    async def load(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        batch = [
            (key, chunk_id, view[chunk_id])
            for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True)
        ]
        if not batch:
            return JobResult(job.job_id, True, successful_keys=[])
        item_bytes = len(batch) * self.ctx.chunk_bytes
        [found] = await in_threads(self._get, [batch], self._reads, item_bytes)
        outcomes = dict(zip(job.keys, found, strict=True))
        loaded = [key for key in job.keys if outcomes[key] is None]
        if len(loaded) < len(job.keys):
            corrupt = {
                key: problem
                for key, problem in outcomes.items()
                if problem is not None and problem not in (_MISSING, _FAILED)
            }
            await self._corrupt.discard(corrupt, f"promotion job {job.job_id}", self._remove)
            failed = sum(1 for problem in outcomes.values() if problem == _FAILED)
            if failed:
                self._log.warning(
                    "load",
                    "%d chunk(s) of promotion job %d could not be fetched",
                    failed,
                    job.job_id,
                )
        return JobResult(job.job_id, len(loaded) == len(job.keys), successful_keys=loaded)

    def _get(self, batch: list[tuple[OffloadKey, int, memoryview]]) -> list[str | None]:
        """Fetch a job's chunks in one call, each row into its slot and its header into
        the arena, and verify them; for each chunk None (served) or what was wrong.
        Runs in an I/O thread, which holds the rows until it returns."""
        assert self._headers is not None
        headers = memoryview(self._headers)
        base = self._headers_address + len(self.ctx.primary_view) * HEADER_BYTES
        names, buffers, sizes = [], [], []
        for key, chunk_id, row in batch:
            names.append(self.object_name(key))
            buffers.append([base + chunk_id * HEADER_BYTES, _address_of(row)])
            sizes.append([HEADER_BYTES, len(row)])
        with self._call() as client:
            got: list[int] = client.batch_get_into_multi_buffers(names, buffers, sizes)
            found: list[str | None] = []
            for (key, chunk_id, row), name, size in zip(batch, names, got, strict=True):
                expected = HEADER_BYTES + len(row)
                if size == expected:
                    offset = (len(self.ctx.primary_view) + chunk_id) * HEADER_BYTES
                    # The bytes in the slot are served only once they match the header.
                    header = headers[offset : offset + HEADER_BYTES]
                    found.append(self._format.verify(header, key, row))
                elif size == OBJECT_NOT_FOUND:
                    found.append(_MISSING)
                else:
                    # A failed transfer or an object of another length: which one, its
                    # size says (a short object fails the transfer too).
                    stored = size if size >= 0 else client.get_size(name)
                    if stored == OBJECT_NOT_FOUND:
                        found.append(_MISSING)
                    elif stored < 0 or stored == expected:
                        found.append(_FAILED)
                    else:
                        found.append("truncated object" if stored < expected else "oversize object")
        return found

    async def _remove(self, keys: Sequence[OffloadKey]) -> Sequence[OffloadKey]:
        """Remove the objects of ``keys``; the keys whose object is gone. Never raises."""
        names = [self.object_name(key) for key in keys]
        try:
            with anyio.fail_after(self.settings.job_deadline_s):
                codes = await anyio.to_thread.run_sync(
                    self._remove_all, names, abandon_on_cancel=True
                )
        except Exception as exc:
            # A remover never raises: the objects fail verification again next time.
            failure = describe_error(exc)
            self._log.warning("remove", "removing %d object(s) failed: %s", len(keys), failure)
            return []
        gone = [key for key, code in zip(keys, codes, strict=True) if code in (0, OBJECT_NOT_FOUND)]
        self._events.add(gone, self.medium, True, self.ctx.tier_name)
        return gone

    def _remove_all(self, names: list[str]) -> list[int]:
        with self._call() as client:
            # Forced: a get leaves a lease on the object (the master's
            # default_kv_lease_ttl) that refuses a plain remove for a while.
            codes: list[int] = client.batch_remove(names, True)
        return codes

    def take_events(self) -> list[OffloadingEvent]:
        return self._events.take()


def _address_of(buffer: memoryview) -> int:
    """The address of a writable buffer's first byte (about a microsecond)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))
