"""The memcached tier: chunks as items of a memcached server, and the model remote tier.

Start here to write a tier for a remote store (Redis, Valkey, a cache service): this
module is complete and small, and it uses nothing of kvtier's that a plugin cannot. It
shows each thing a remote tier has to get right:

- its parameters are a frozen record parsed before anything is built
  (:class:`MemcachedSettings`), credentials in a :class:`~kvtier.tiers.kit.Secret`, and
  what it derives from the engine (the item size, the deadline of a job's I/O) filled
  in once, by :meth:`MemcachedTier.effective_settings`, from which the tier is built;
- connections open in ``start`` and close in ``aclose``; a connection whose exchange
  was cut (an error, a time-out, a cancelled job) is closed, never reused;
- every chunk goes out framed by :mod:`kvtier.format` (a header with the key, the
  namespace and checksums of header and payload) and is verified before a load reports
  it: a corrupt, truncated or foreign item is counted, deleted and never served
  (:class:`~kvtier.tiers.kit.CorruptChunks`);
- a job's I/O ends at :func:`~kvtier.tiers.kit.job_deadline_s`, before the
  framework's time-out, and recurring failures are logged once
  (:class:`~kvtier.tiers.kit.ThrottledLog`);
- it says what it is: remote memory (:attr:`~kvtier.records.Medium.REMOTE_MEMORY`), so
  a host reports its hits as coming from an external store.

Protocol: memcached's text protocol, which memcached has spoken since its first
versions (and servers compatible with it do)::

    add <item> 0 <ttl> <bytes>\\r\\n<header><row>\\r\\n  STORED | NOT_STORED (kept as is)
    get <item>\\r\\n          VALUE <item> <flags> <bytes>\\r\\n<data>\\r\\nEND\\r\\n | END\\r\\n
    touch <item> <ttl>\\r\\n  TOUCHED | NOT_FOUND (a lookup, which renews the item's ttl)
    delete <item>\\r\\n       DELETED | NOT_FOUND
    set auth 0 0 <n>\\r\\n<username> <password>\\r\\n   STORED (memcached -Y <authfile>)

Items are named ``<model>_<namespace digest>/<key hex>``. A memcached item holds at most
the server's item size (``-I``, 1 MiB by default), and a chunk's item is its header
(4 KiB) plus its primary row: start memcached with ``-I`` above that and set
``max_item_bytes`` to match.

Configuration::

    {"type": "memcached", "server": "10.0.0.9:11211", "max_item_bytes": 67108864}
"""

from __future__ import annotations

import contextlib
import logging
import select
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio
from anyio.abc import SocketAttribute, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from kvtier.errors import KVTierError
from kvtier.format import HEADER_BYTES, ChunkFormat, namespace_directory
from kvtier.keys import OffloadKey
from kvtier.metrics import CounterDef, MetricDefinition
from kvtier.records import Locality, Medium, OffloadingEvent
from kvtier.resources import AsyncResource
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob
from kvtier.tiers.kit import (
    ConfigError,
    ConfigReader,
    CorruptChunks,
    EventLog,
    Secret,
    ThrottledLog,
    derived_field,
    describe_error,
    job_deadline_s,
    parse_address,
    read_secret,
)

__all__ = ["MemcachedError", "MemcachedSettings", "MemcachedTier"]

logger = logging.getLogger(__name__)

STORES_SKIPPED = "kvtier_memcached_stores_skipped"

MIB = 1 << 20
DEFAULT_SERVER = ("127.0.0.1", 11211)
# memcached's own default item size (-I 1m).
DEFAULT_MAX_ITEM_BYTES = MIB
# What an item costs the server besides its value: the item's name, flags and its own
# header, well under this (memcached's item header is about 50 bytes).
ITEM_OVERHEAD = 512
# Requests in flight per tier, each on its own connection. memcached answers a get from
# memory in microseconds: a few connections keep a LAN link busy.
DEFAULT_MAX_CONNECTIONS = 8
# A server on the LAN accepts in milliseconds; a dead one should not hold a job long.
DEFAULT_CONNECT_TIMEOUT_S = 2.0
# Far beyond what a reply line needs ("VALUE <250-byte name> <flags> <bytes>"): a
# longer line is not memcached speaking.
_MAX_LINE_BYTES = 1024


class MemcachedError(KVTierError):
    """The server answered something other than the protocol allows at that point."""


@dataclass(frozen=True)
class MemcachedSettings:
    """The memcached tier's parameters (``{"type": "memcached", "server": ...}``)."""

    #: ``"host:port"`` of the server (``"127.0.0.1:11211"``).
    server: tuple[str, int] = DEFAULT_SERVER
    #: The user of memcached's ASCII authentication (``memcached -Y <authfile>``); None
    #: (the default): the server asks for none.
    username: str | None = None
    #: That user's password; required exactly when ``username`` is given.
    password: Secret[str] | None = None
    #: Connections, and so requests in flight, at once (8).
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: Seconds to connect (and authenticate) before the attempt fails (2).
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    #: Seconds an item lives, renewed by each lookup that finds it; 0 (the default):
    #: until the server needs the room (it evicts least recently used items).
    ttl_s: int = 0
    #: The largest item the server stores: its ``-I`` (1 MiB, memcached's default).
    max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES
    #: Seconds a job's requests may take together before the job fails. None (the
    #: default): two thirds of the tier's ``job_timeout_s``; it must stay below it.
    job_deadline_s: float | None = None
    #: The size of a chunk's item (header + primary row). Not a parameter: derived
    #: from the engine's chunk size.
    item_bytes: int | None = derived_field()

    @classmethod
    def from_params(cls, params: Mapping[str, Any], path: str) -> MemcachedSettings:
        """Read the tier's parameters; errors name ``path.<parameter>``, never the password."""
        reader = ConfigReader(params, path)
        server = parse_address(reader.string("server", "127.0.0.1:11211"), reader.path_of("server"))
        username: str | None = reader.string("username", None)
        password = read_secret(reader, "password")
        if (username is None) != (password is None):
            missing = "password" if password is None else "username"
            raise ConfigError(reader.path_of(missing), "is required with the other one")
        settings = cls(
            server=server,
            username=username,
            password=password,
            max_connections=reader.integer(
                "max_connections", DEFAULT_MAX_CONNECTIONS, minimum=1, maximum=1024
            ),
            connect_timeout_s=reader.number(
                "connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S, minimum=0, exclusive_minimum=True
            ),
            # memcached reads a ttl above 30 days as a point in time: keep below it.
            ttl_s=reader.integer("ttl_s", 0, minimum=0, maximum=30 * 24 * 3600),
            max_item_bytes=reader.integer("max_item_bytes", DEFAULT_MAX_ITEM_BYTES, minimum=1),
            job_deadline_s=reader.number("job_deadline_s", None, minimum=0, exclusive_minimum=True),
        )
        reader.reject_unknown()
        return settings

    def for_engine(self, *, chunk_bytes: int, job_timeout_s: float, path: str) -> MemcachedSettings:
        """These settings for an engine's chunks and job time-out.

        Raises:
            ConfigError: a chunk's item would not fit ``max_item_bytes``, or
                ``job_deadline_s`` is not below ``job_timeout_s``.
        """
        item_bytes = HEADER_BYTES + chunk_bytes
        if item_bytes + ITEM_OVERHEAD > self.max_item_bytes:
            need = -(-(item_bytes + ITEM_OVERHEAD) // MIB)
            raise ConfigError(
                f"{path}.max_item_bytes",
                f"a chunk's item takes {item_bytes} bytes, more than {self.max_item_bytes}: "
                f"start memcached with -I {need}m and set max_item_bytes to {need * MIB}",
            )
        deadline = job_deadline_s(job_timeout_s, self.job_deadline_s, f"{path}.job_deadline_s")
        return replace(self, item_bytes=item_bytes, job_deadline_s=deadline)


class MemcachedTier(SecondaryTier):
    """Chunks as items of a memcached server (parameters: :class:`MemcachedSettings`)."""

    medium = Medium.REMOTE_MEMORY
    locality = Locality.REMOTE
    settings_class = MemcachedSettings

    def __init__(self, ctx: TierContext, settings: MemcachedSettings) -> None:
        super().__init__(ctx)
        # Filled in by effective_settings, from which the framework builds the tier.
        assert settings.item_bytes is not None and settings.job_deadline_s is not None
        self.settings = settings
        self._format = ChunkFormat(ctx.namespace)
        self._prefix = namespace_directory(ctx.model_name, self._format)
        self._pool = _Pool(settings)
        self._events = EventLog(ctx.enable_events)
        self._log = ThrottledLog(logger, f"tier {ctx.tier_name}")
        self._corrupt = CorruptChunks(ctx, self._log, self.item_name)

    @classmethod
    def effective_settings(
        cls, settings: Any, *, chunk_bytes: int, job_timeout_s: float, path: str
    ) -> MemcachedSettings:
        given: MemcachedSettings = settings
        return given.for_engine(chunk_bytes=chunk_bytes, job_timeout_s=job_timeout_s, path=path)

    @classmethod
    def build_metric_definitions(cls, settings: Any) -> dict[str, MetricDefinition]:
        return {
            STORES_SKIPPED: CounterDef(
                "Chunks the memcached tier did not store because the server held them "
                "already, by tier.",
                ("tier",),
            )
        }

    def item_name(self, key: OffloadKey) -> str:
        """The name of ``key``'s item on the server."""
        return f"{self._prefix}/{key.hex()}"

    async def start(self) -> None:
        # One exchange now, so that a wrong address or password fails the start with
        # a message naming the setting, not every job later.
        host, port = self.settings.server
        path = self.ctx.config_path
        try:
            async with self._pool.connection() as connection:
                await connection.command(b"version\r\n", (b"VERSION",))
        except (OSError, TimeoutError) as exc:
            raise ConfigError(
                f"{path}.server", f"cannot reach memcached at {host}:{port}: {describe_error(exc)}"
            ) from None
        except MemcachedError as exc:
            where = "username" if self.settings.username is not None else "server"
            raise ConfigError(f"{path}.{where}", f"{host}:{port} refused: {exc}") from None
        logger.info("tier %s: memcached at %s:%d", self.ctx.tier_name, host, port)

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        # One connection, the commands sent back to back: one round trip for the batch.
        ttl = self.settings.ttl_s
        commands = [f"touch {self.item_name(key)} {ttl}\r\n".encode() for key in keys]
        with anyio.fail_after(self.settings.job_deadline_s):
            async with self._pool.connection() as connection:
                answers = await connection.pipeline(commands, (b"TOUCHED", b"NOT_FOUND"))
        return [answer == b"TOUCHED" for answer in answers]

    async def store(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        stored: list[OffloadKey] = []
        skipped = 0

        async def store_one(key: OffloadKey, chunk_id: int) -> None:
            nonlocal skipped
            row = view[chunk_id]
            # xxh3 of a 2 MiB row takes ~0.1 ms: on the loop, with the send that follows.
            header = self._format.header(key, row)
            # One bytes object for the whole command: after send() returns the transport
            # may still hold what it could not write yet, and the slot is not this
            # job's once it ends.
            command = b"".join(
                (
                    f"add {self.item_name(key)} 0 {self.settings.ttl_s} "
                    f"{len(header) + len(row)}\r\n".encode(),
                    header,
                    row,
                    b"\r\n",
                )
            )
            async with self._pool.connection() as connection:
                answer = await connection.command(command, (b"STORED", b"NOT_STORED"))
            if answer == b"STORED":
                stored.append(key)
            else:
                skipped += 1  # add keeps an item already there

        try:
            with anyio.fail_after(self.settings.job_deadline_s):
                async with anyio.create_task_group() as group:
                    for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
                        group.start_soon(store_one, key, chunk_id)
        finally:
            # Whatever was stored is there, even if the job was cut short.
            self._events.add(stored, self.medium, False, self.ctx.tier_name)
            self.ctx.metrics.inc(STORES_SKIPPED, skipped, (self.ctx.tier_name,))
        return JobResult(job.job_id, True, transfer_bytes=len(stored) * self.ctx.chunk_bytes)

    async def load(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        problems: dict[OffloadKey, str | None] = {}

        async def load_one(key: OffloadKey, chunk_id: int) -> None:
            row = view[chunk_id]
            async with self._pool.connection() as connection:
                item = await connection.get(f"get {self.item_name(key)}\r\n".encode())
            if item is None:
                problems[key] = None  # not there (any more): a miss, nothing wrong
            elif len(item) != HEADER_BYTES + len(row):
                short = len(item) < HEADER_BYTES + len(row)
                problems[key] = "truncated item" if short else "oversize item"
            else:
                row[:] = item[HEADER_BYTES:]
                # The bytes in the slot are served only once they match the header.
                problem = self._format.verify(item[:HEADER_BYTES], key, row)
                if problem is not None:
                    problems[key] = problem

        with anyio.fail_after(self.settings.job_deadline_s):
            async with anyio.create_task_group() as group:
                for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
                    group.start_soon(load_one, key, chunk_id)
            corrupt = {key: problem for key, problem in problems.items() if problem is not None}
            await self._corrupt.discard(corrupt, f"promotion job {job.job_id}", self._delete)
        loaded = [key for key in job.keys if key not in problems]
        return JobResult(job.job_id, not problems, successful_keys=loaded)

    async def _delete(self, keys: Sequence[OffloadKey]) -> Sequence[OffloadKey]:
        """Delete the items of ``keys``; the keys whose item is gone. Never raises."""
        commands = [f"delete {self.item_name(key)}\r\n".encode() for key in keys]
        try:
            async with self._pool.connection() as connection:
                await connection.pipeline(commands, (b"DELETED", b"NOT_FOUND"))
        except Exception as exc:
            # A remover never raises: the items fail verification again next time.
            failure = describe_error(exc)
            self._log.warning("delete", "deleting %d item(s) failed: %s", len(keys), failure)
            return []
        self._events.add(keys, self.medium, True, self.ctx.tier_name)
        return keys

    def take_events(self) -> list[OffloadingEvent]:
        return self._events.take()


class _Connection:
    """One connection to the server: a command at a time, its answer read whole."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self._reader = BufferedByteReceiveStream(stream)

    def idle_and_open(self) -> bool:
        """Whether an idle connection may carry the next exchange: the server has not
        closed it (a server restarted since the last exchange has) and sent nothing
        unasked. Looks without blocking: an idle connection in step has nothing to
        read, so one that polls readable was closed or reset by the server, or is out
        of step."""
        sock = self.stream.extra(SocketAttribute.raw_socket, None)
        if sock is None:
            return True
        poll = select.poll()
        poll.register(sock.fileno(), select.POLLIN)
        return not poll.poll(0)

    async def command(self, command: bytes, expected: tuple[bytes, ...]) -> bytes:
        """Send ``command``; its one-line answer, which must be one of ``expected``."""
        await self.stream.send(command)
        return await self._answer(expected)

    async def pipeline(self, commands: Sequence[bytes], expected: tuple[bytes, ...]) -> list[bytes]:
        """Send ``commands`` at once; their one-line answers, in order."""
        if not commands:
            return []
        await self.stream.send(b"".join(commands))
        return [await self._answer(expected) for _ in commands]

    async def get(self, command: bytes) -> bytes | None:
        """Send a ``get``; the item's value, or None when the server has none."""
        await self.stream.send(command)
        line = await self._line()
        if line == b"END":
            return None
        parts = line.split()
        if len(parts) != 4 or parts[0] != b"VALUE" or not parts[3].isdigit():
            raise MemcachedError(f"unexpected answer to get: {line[:80]!r}")
        data = await self._reader.receive_exactly(int(parts[3]) + 2)
        if data[-2:] != b"\r\n" or await self._line() != b"END":
            raise MemcachedError("a value that does not end as the protocol says")
        return data[:-2]

    async def _answer(self, expected: tuple[bytes, ...]) -> bytes:
        """The first word of the answer line (``VERSION 1.6.21``: ``VERSION``)."""
        line = await self._line()
        word = line.partition(b" ")[0]
        if word not in expected:
            raise MemcachedError(f"expected {' or '.join(map(repr, expected))}, got {line[:80]!r}")
        return word

    async def _line(self) -> bytes:
        return await self._reader.receive_until(b"\r\n", _MAX_LINE_BYTES)


class _Pool(AsyncResource):
    """Connections to the server, at most ``max_connections``, reused while they work."""

    def __init__(self, settings: MemcachedSettings) -> None:
        self._settings = settings
        self._limit = anyio.Semaphore(settings.max_connections)
        self._idle: list[_Connection] = []
        self._closed = False

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[_Connection]:
        """A connection for one exchange; closed, not reused, if the exchange fails.

        An idle connection the server closed meanwhile (it was restarted) is dropped
        rather than handed out, so the first job after a restart does not fail on it.
        """
        async with self._limit:
            connection = await self._take_idle() or await self._connect()
            try:
                yield connection
            except BaseException:
                # The exchange stopped half way: what the server sends next is unknown.
                with anyio.CancelScope(shield=True):
                    await connection.stream.aclose()
                raise
            if self._closed:
                # The pool closed during the exchange: nobody would close it later.
                with anyio.CancelScope(shield=True):
                    await connection.stream.aclose()
            else:
                self._idle.append(connection)

    async def _take_idle(self) -> _Connection | None:
        idle = self._idle
        while idle:
            connection = idle.pop()
            if connection.idle_and_open():
                return connection
            with anyio.CancelScope(shield=True):
                await connection.stream.aclose()
        return None

    async def _connect(self) -> _Connection:
        settings = self._settings
        host, port = settings.server
        with anyio.fail_after(settings.connect_timeout_s):
            connection = _Connection(await anyio.connect_tcp(host, port))
            if settings.username is None or settings.password is None:
                return connection
            credentials = f"{settings.username} {settings.password.value}".encode()
            try:
                await connection.command(
                    b"set auth 0 0 %d\r\n%s\r\n" % (len(credentials), credentials),
                    (b"STORED",),
                )
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await connection.stream.aclose()
                raise
        return connection

    async def aclose(self) -> None:
        """Close the idle connections (those in use close with their exchange).
        Idempotent."""
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            await connection.stream.aclose()
