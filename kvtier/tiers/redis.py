"""The redis tier: chunks as values of a Redis server, a Valkey server or a Redis Cluster.

Built like the memcached tier (:mod:`kvtier.tiers.memcached`, the model remote tier)
from the parts of :mod:`kvtier.tiers.kit`, on redis-py's asyncio client:

- each chunk is one value, framed by :mod:`kvtier.format` (a header with the key, the
  namespace and checksums of header and payload, then the primary row), named
  ``<model>_<namespace digest>/<key hex>``, so that engines of one namespace share
  their chunks and no other namespace ever reads them;
- a job is one pipeline, one round trip for its batch (on a cluster, one per node
  that holds some of its keys, all at once); a job of more than ``pipeline_bytes``
  goes as several pipelines at once, each on a connection of its own: ``SET NX``
  stores a chunk unless the server holds it already (an existing chunk is kept, and
  counted as skipped), ``GET`` loads, ``EXISTS`` looks up (``EXPIRE`` when values have
  a ``ttl_s``, so a lookup that finds a chunk renews its life);
- a loaded value is verified before the load reports it: a value overwritten,
  truncated or foreign is counted, deleted and never served
  (:class:`~kvtier.tiers.kit.CorruptChunks`);
- a job's requests end at :func:`~kvtier.tiers.kit.job_deadline_s`; a connection
  whose request was cut short (an error, the deadline, a cancelled job) is closed by
  redis-py, never reused; a server that went away is reconnected to by the next job;
- the password comes from the url or from ``password_file`` (a file only its owner
  may read, read at start), and is never shown; a wrong one fails the start.

Configuration::

    {"type": "redis", "url": "redis://10.0.0.9:6379/0",
     "password_file": "/etc/kvtier/redis.pass", "ttl_s": 86400}
    {"type": "redis", "url": "rediss://10.0.0.9:6380", "cluster": true,
     "tls_ca_file": "/etc/kvtier/ca.pem"}

A Redis value holds at most the server's ``proto-max-bulk-len`` (512 MiB by default);
a chunk's value is its header (4 KiB) plus its primary row. The server should evict
under memory pressure (``maxmemory`` with an ``allkeys-*`` policy) or the values get a
``ttl_s``: the tier never deletes a chunk it stored except a corrupt one or on a clear.
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel

try:
    from redis.asyncio import Redis
    from redis.asyncio.client import Pipeline
    from redis.asyncio.cluster import ClusterPipeline, RedisCluster
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import AuthenticationError, RedisClusterException, ResponseError
except ImportError as exc:  # the registry's error names the tier's type key
    hint = "the redis tier needs redis-py: pip install 'redis>=5.0.1' (kvtier's extra redis)"
    raise ImportError(f"{hint} ({exc})") from exc

from kvtier.errors import KVTierError
from kvtier.format import HEADER_BYTES, ChunkFormat, namespace_directory
from kvtier.keys import OffloadKey
from kvtier.metrics import CounterDef, MetricDefinition
from kvtier.records import Locality, Medium, OffloadingEvent
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
    read_secret_file,
)

__all__ = ["RedisSettings", "RedisTier", "RedisUnavailable"]

logger = logging.getLogger(__name__)

STORES_SKIPPED = "kvtier_redis_stores_skipped"

MIB = 1 << 20
DEFAULT_URL = "redis://127.0.0.1:6379/0"
_SCHEMES = ("redis", "rediss")
_DEFAULT_PORT = 6379
# Redis's own limit on one value (proto-max-bulk-len, 512 MiB by default).
DEFAULT_MAX_VALUE_BYTES = 512 * MIB
# Small chunks go hundreds to a round trip; a chunk of 2 MiB or more goes alone, as
# with memcached. Bigger pipelines cost more than they save: asyncio's transport
# (Python 3.11) joins a pipeline into one buffer and moves what is left of it after
# each send. Measured here (2-core VM, a job of 64 chunks of 2 MiB): 64 MiB pipelines
# stored ~100-140 MB/s and stalled the loop up to ~300 ms; 4 MiB ones ~400-600 MB/s,
# stalls under ~40 ms. A job holds at most max_connections times this in copies.
DEFAULT_PIPELINE_BYTES = 4 * MIB
# Pipelines in flight per tier, each on its own connection (per node of a cluster).
# A server answers from memory in microseconds: a few connections keep a LAN link
# busy, and Redis serves them from one thread anyway.
DEFAULT_MAX_CONNECTIONS = 8
# A server on the LAN accepts in milliseconds; a dead one should not hold a job long.
DEFAULT_CONNECT_TIMEOUT_S = 2.0
# One retry, at once, of a request whose connection failed: an idle connection the
# server closed (it restarted) fails once and the retry runs on a new one. A server
# that is down fails both quickly; longer back-offs would only spend the job's deadline.
_RETRIES = 1
# Connections a client may open beyond the tier's pipelines (see _client).
_CLIENT_CONNECTIONS = 2
# Names deleted per command by a clear: a few hundred keep each command short.
_CLEAR_BATCH = 256
# Names a clear asks each SCAN for (a hint to the server, not a limit).
_SCAN_COUNT = 1000
# What a Redis glob pattern treats as special.
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


#: A pipeline of either client: commands queue in it, one ``execute`` sends them.
_Pipe = Pipeline | ClusterPipeline


class RedisUnavailable(KVTierError):
    """The redis tier was used before ``start`` or after ``aclose``."""


@dataclass(frozen=True)
class RedisSettings:
    """The redis tier's parameters (``{"type": "redis", "url": ...}``)."""

    #: The server, ``redis://[user@]host[:port][/db]`` or ``rediss://`` for TLS
    #: (``"redis://127.0.0.1:6379/0"``); a password in it is moved to
    #: :attr:`password`, so this never shows one. With ``cluster``, any node of the
    #: cluster (database 0 only).
    url: str = DEFAULT_URL
    #: The password the url held, hidden; None: none there.
    password: Secret[str] | None = None
    #: A file holding the password (mode 0600, read at start); None: the url's
    #: password, or none.
    password_file: Path | None = None
    #: Whether the url names a node of a Redis Cluster (false).
    cluster: bool = False
    #: Seconds a value lives, renewed by each lookup that finds it; None (the
    #: default): until the server evicts it (its ``maxmemory-policy``).
    ttl_s: int | None = None
    #: Connections, and so pipelines in flight, at once (per node of a cluster) (8).
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: Seconds to connect (TLS and authentication included) before the attempt
    #: fails (2).
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    #: The largest value the server takes: its ``proto-max-bulk-len`` (512 MiB).
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    #: With ``rediss://``: the certificates (PEM) that sign the server's; None: the
    #: system's.
    tls_ca_file: Path | None = None
    #: With ``rediss://``: this client's certificate (PEM), for a server that asks
    #: for one (``tls-auth-clients yes``); None: none.
    tls_cert_file: Path | None = None
    #: The private key of ``tls_cert_file`` (PEM); required exactly with it.
    tls_key_file: Path | None = None
    #: The most value bytes one pipeline carries (4 MiB): a bigger job is cut into
    #: pipelines of at most this much, sent on connections of their own at once, so
    #: that the copies a job holds while they travel stay bounded.
    pipeline_bytes: int = DEFAULT_PIPELINE_BYTES
    #: Seconds a job's requests may take together before the job fails. None (the
    #: default): two thirds of the tier's ``job_timeout_s``; it must stay below it.
    job_deadline_s: float | None = None
    #: The size of a chunk's value (header + primary row). Not a parameter: derived
    #: from the engine's chunk size.
    value_bytes: int | None = derived_field()
    #: Chunks per pipeline of a store or a load (at least one). Not a parameter:
    #: derived from ``pipeline_bytes`` and the chunk size.
    pipeline_chunks: int | None = derived_field()

    @classmethod
    def from_params(cls, params: Mapping[str, Any], path: str) -> RedisSettings:
        """Read the tier's parameters; errors name ``path.<parameter>``, never a password."""
        reader = ConfigReader(params, path)
        url, password = _parse_url(reader.string("url", DEFAULT_URL, secret=True), reader)
        cluster: bool = reader.boolean("cluster", False)
        password_file = _path(reader, "password_file")
        if password_file is not None and password is not None:
            raise ConfigError(
                reader.path_of("password_file"), "the url holds a password already: give one"
            )
        if cluster and _database(url) != 0:
            raise ConfigError(reader.path_of("url"), "a Redis Cluster has database 0 only")
        tls = [_path(reader, key) for key in ("tls_ca_file", "tls_cert_file", "tls_key_file")]
        if any(value is not None for value in tls) and not url.startswith("rediss://"):
            given = next(key for key, value in zip(_TLS_KEYS, tls, strict=True) if value)
            raise ConfigError(reader.path_of(given), "needs a rediss:// url (TLS)")
        if (tls[1] is None) != (tls[2] is None):
            missing = "tls_key_file" if tls[2] is None else "tls_cert_file"
            raise ConfigError(reader.path_of(missing), "is required with the other one")
        settings = cls(
            url=url,
            password=password,
            password_file=password_file,
            cluster=cluster,
            # Redis keeps an expiry in milliseconds of a 64-bit integer; a year is
            # far beyond any use of a KV cache and far below that.
            ttl_s=reader.integer("ttl_s", None, minimum=1, maximum=366 * 24 * 3600),
            max_connections=reader.integer(
                "max_connections", DEFAULT_MAX_CONNECTIONS, minimum=1, maximum=1024
            ),
            connect_timeout_s=reader.number(
                "connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S, minimum=0, exclusive_minimum=True
            ),
            max_value_bytes=reader.integer(
                "max_value_bytes", DEFAULT_MAX_VALUE_BYTES, minimum=HEADER_BYTES + 1
            ),
            tls_ca_file=tls[0],
            tls_cert_file=tls[1],
            tls_key_file=tls[2],
            pipeline_bytes=reader.integer(
                "pipeline_bytes", DEFAULT_PIPELINE_BYTES, minimum=HEADER_BYTES + 1
            ),
            job_deadline_s=reader.number("job_deadline_s", None, minimum=0, exclusive_minimum=True),
        )
        reader.reject_unknown()
        return settings

    def for_engine(self, *, chunk_bytes: int, job_timeout_s: float, path: str) -> RedisSettings:
        """These settings for an engine's chunks and job time-out.

        Raises:
            ConfigError: a chunk's value would not fit ``max_value_bytes``, or
                ``job_deadline_s`` is not below ``job_timeout_s``.
        """
        value_bytes = HEADER_BYTES + chunk_bytes
        if value_bytes > self.max_value_bytes:
            raise ConfigError(
                f"{path}.max_value_bytes",
                f"a chunk's value takes {value_bytes} bytes, more than {self.max_value_bytes}: "
                f"raise the server's proto-max-bulk-len to at least {value_bytes} and set "
                "max_value_bytes to match, or use smaller chunks (block_size)",
            )
        deadline = job_deadline_s(job_timeout_s, self.job_deadline_s, f"{path}.job_deadline_s")
        return replace(
            self,
            value_bytes=value_bytes,
            pipeline_chunks=max(1, self.pipeline_bytes // value_bytes),
            job_deadline_s=deadline,
        )


_TLS_KEYS = ("tls_ca_file", "tls_cert_file", "tls_key_file")


def _path(reader: ConfigReader, key: str) -> Path | None:
    value: str | None = reader.string(key, None)
    return None if value is None else Path(value)


def _parse_url(value: str, reader: ConfigReader) -> tuple[str, Secret[str] | None]:
    """``value`` without its password, and the password; errors never show it."""
    path = reader.path_of("url")
    expected = "expected redis://[user@]host[:port][/db] or rediss://…"
    try:
        parts = urllib.parse.urlsplit(value)
        port = parts.port or _DEFAULT_PORT
    except ValueError:
        raise ConfigError(path, f"{expected}: the port is not a number from 1 to 65535") from None
    shown = _without_password(parts, port)
    if parts.scheme not in _SCHEMES:
        raise ConfigError(path, f"{expected}, got {shown}")
    if not parts.hostname:
        raise ConfigError(path, f"{expected}: {shown} names no host")
    if parts.query or parts.fragment:
        raise ConfigError(
            path, f"{expected}: {shown} has a query; give options as the tier's settings"
        )
    database = parts.path.lstrip("/")
    if database and not database.isdigit():
        raise ConfigError(path, f"{expected}: the database of {shown} is not a number")
    password = None if parts.password is None else urllib.parse.unquote(parts.password)
    return shown, (Secret(password) if password else None)


def _without_password(parts: urllib.parse.SplitResult, port: int) -> str:
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    user = f"{parts.username}@" if parts.username else ""
    database = parts.path.lstrip("/") or "0"
    return f"{parts.scheme}://{user}{host}:{port}/{database}"


def _database(url: str) -> int:
    return int(urllib.parse.urlsplit(url).path.lstrip("/") or 0)


class RedisTier(SecondaryTier):
    """Chunks as values of a Redis server or cluster (parameters: :class:`RedisSettings`)."""

    medium = Medium.REMOTE_MEMORY
    locality = Locality.REMOTE
    settings_class = RedisSettings

    def __init__(self, ctx: TierContext, settings: RedisSettings) -> None:
        super().__init__(ctx)
        # Filled in by effective_settings, from which the framework builds the tier.
        assert settings.value_bytes is not None and settings.job_deadline_s is not None
        assert settings.pipeline_chunks is not None
        self.settings = settings
        self._deadline_s: float = settings.job_deadline_s
        self._pipeline_chunks: int = settings.pipeline_chunks
        self._format = ChunkFormat(ctx.namespace)
        self._prefix = namespace_directory(ctx.model_name, self._format)
        # redis-py's pools refuse (rather than wait for) a connection past their size:
        # a job waits here for its turn instead.
        self._limit = anyio.Semaphore(settings.max_connections)
        self._client: Redis | RedisCluster | None = None
        self._events = EventLog(ctx.enable_events)
        self._log = ThrottledLog(logger, f"tier {ctx.tier_name}")
        self._corrupt = CorruptChunks(ctx, self._log, self.value_name)

    @classmethod
    def effective_settings(
        cls, settings: Any, *, chunk_bytes: int, job_timeout_s: float, path: str
    ) -> RedisSettings:
        given: RedisSettings = settings
        return given.for_engine(chunk_bytes=chunk_bytes, job_timeout_s=job_timeout_s, path=path)

    @classmethod
    def build_metric_definitions(cls, settings: Any) -> dict[str, MetricDefinition]:
        return {
            STORES_SKIPPED: CounterDef(
                "Chunks the redis tier did not store because the server held them "
                "already, by tier.",
                ("tier",),
            )
        }

    def value_name(self, key: OffloadKey) -> str:
        """The name of ``key``'s value on the server."""
        return f"{self._prefix}/{key.hex()}"

    async def start(self) -> None:
        # One exchange now, so that a wrong address, password or certificate fails the
        # start with a message naming the setting, not every job later.
        settings = self.settings
        path = self.ctx.config_path
        password = settings.password
        if settings.password_file is not None:
            secret = await anyio.to_thread.run_sync(
                read_secret_file, str(settings.password_file), f"{path}.password_file"
            )
            try:
                password = Secret(secret.value.decode())
            except UnicodeDecodeError:
                raise ConfigError(
                    f"{path}.password_file", f"{settings.password_file} is not UTF-8 text"
                ) from None
        self._client = _client(settings, password)
        try:
            with anyio.fail_after(settings.connect_timeout_s + self._deadline_s):
                await self._check_server()
        except BaseException as exc:
            await self.aclose()
            if isinstance(exc, Exception):
                raise self._start_error(exc, password is not None) from None
            raise
        logger.info(
            "tier %s: %s at %s",
            self.ctx.tier_name,
            "Redis Cluster" if settings.cluster else "Redis",
            settings.url,
        )

    async def _check_server(self) -> None:
        client = self._connected()
        if isinstance(client, RedisCluster):
            await client.initialize()
        await client.ping()
        if not self.settings.cluster:
            try:
                info = await client.info("cluster")
            except ResponseError:
                return  # a user not allowed INFO: nothing to check, the jobs will tell
            if info.get("cluster_enabled"):
                raise ConfigError(
                    f"{self.ctx.config_path}.cluster",
                    f"{self.settings.url} is a node of a Redis Cluster: set cluster to true",
                )

    def _start_error(self, exc: Exception, has_password: bool) -> Exception:
        """The ConfigError that says why the first exchange with the server failed."""
        path = self.ctx.config_path
        url = self.settings.url
        if isinstance(exc, ConfigError):
            return exc
        if isinstance(exc, AuthenticationError):
            where = "password_file" if self.settings.password_file is not None else "url"
            said = "refused the password" if has_password else "asks for a password"
            return ConfigError(f"{path}.{where}", f"{url} {said}: {describe_error(exc)}")
        if isinstance(exc, RedisClusterException):
            return ConfigError(f"{path}.cluster", f"{url}: {describe_error(exc)}")
        return ConfigError(f"{path}.url", f"cannot reach Redis at {url}: {describe_error(exc)}")

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        ttl = self.settings.ttl_s

        async def queue(pipe: _Pipe) -> None:
            for key in keys:
                if ttl is None:
                    pipe.exists(self.value_name(key))
                else:
                    pipe.expire(self.value_name(key), ttl)

        answers = await self._pipeline(queue)
        return [bool(answer) for answer in answers]

    async def store(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        ttl = self.settings.ttl_s
        stored: list[OffloadKey] = []
        skipped = 0

        async def store_part(part: Sequence[tuple[OffloadKey, int]]) -> None:
            nonlocal skipped

            async def queue(pipe: _Pipe) -> None:
                for key, chunk_id in part:
                    row = view[chunk_id]
                    # xxh3 of a 2 MiB row takes ~0.1 ms, and its copy about as long: on
                    # the loop, one chunk at a time, letting other tasks run in between.
                    header = self._format.header(key, row)
                    # One bytes object per value: the transport may still hold what it
                    # has not written when the job ends, and the slot is not the job's then.
                    value = b"".join((header, row))
                    pipe.set(self.value_name(key), value, nx=True, ex=ttl)
                    await anyio.lowlevel.checkpoint()

            answers = await self._pipeline(queue, deadline=False)
            for (key, _), answer in zip(part, answers, strict=True):
                if answer:
                    stored.append(key)
                else:
                    skipped += 1  # SET NX keeps a value already there

        try:
            await self._in_parts(job, store_part)
        finally:
            # Whatever was stored is there, even if the job was cut short.
            self._events.add(stored, self.medium, False, self.ctx.tier_name)
            self.ctx.metrics.inc(STORES_SKIPPED, skipped, (self.ctx.tier_name,))
        return JobResult(job.job_id, True, transfer_bytes=len(stored) * self.ctx.chunk_bytes)

    async def load(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        problems: dict[OffloadKey, str | None] = {}

        async def load_part(part: Sequence[tuple[OffloadKey, int]]) -> None:
            async def queue(pipe: _Pipe) -> None:
                for key, _ in part:
                    pipe.get(self.value_name(key))

            values = await self._pipeline(queue, deadline=False)
            for (key, chunk_id), value in zip(part, values, strict=True):
                if value is None:
                    problems[key] = None  # not there (any more): a miss, nothing wrong
                    continue
                problem = self._fill(view[chunk_id], key, value)
                if problem is not None:
                    problems[key] = problem
                # A copy and a checksum per chunk: let other tasks run in between.
                await anyio.lowlevel.checkpoint()

        with anyio.fail_after(self._deadline_s):
            await self._in_parts(job, load_part)
            corrupt = {key: problem for key, problem in problems.items() if problem is not None}
            await self._corrupt.discard(corrupt, f"promotion job {job.job_id}", self._delete)
        loaded = [key for key in job.keys if key not in problems]
        return JobResult(job.job_id, not problems, successful_keys=loaded)

    def _fill(self, row: memoryview, key: OffloadKey, value: bytes) -> str | None:
        """Copy ``value``, ``key``'s chunk as the server held it, into ``row``; what is
        wrong with it, or None once its bytes in ``row`` are verified."""
        if len(value) != HEADER_BYTES + len(row):
            return "truncated value" if len(value) < HEADER_BYTES + len(row) else "oversize value"
        data = memoryview(value)
        row[:] = data[HEADER_BYTES:]
        # The bytes in the slot are served only once they match the header.
        return self._format.verify(data[:HEADER_BYTES], key, row)

    async def _in_parts(
        self,
        job: TransferJob,
        run: Callable[[Sequence[tuple[OffloadKey, int]]], Coroutine[Any, Any, None]],
    ) -> None:
        """``run`` each part of ``job`` (its keys and slots, ``pipeline_chunks`` at a
        time), the parts at once, all within the job's deadline."""
        pairs = list(zip(job.keys, job.chunk_ids, strict=True))
        size = self._pipeline_chunks
        with anyio.fail_after(self._deadline_s):
            if len(pairs) <= size:
                await run(pairs)
                return
            async with anyio.create_task_group() as group:
                for start in range(0, len(pairs), size):
                    group.start_soon(run, pairs[start : start + size])

    async def clear(self) -> bool:
        client = self._connected()
        pattern = _GLOB_SPECIAL.sub(r"\\\1", self._prefix) + "/*"
        batch: list[OffloadKey] = []
        async for name in client.scan_iter(match=pattern, count=_SCAN_COUNT):
            key = self._key_of(name)
            if key is not None:
                batch.append(key)
            if len(batch) >= _CLEAR_BATCH:
                await self._remove(batch)
                batch = []
        if batch:
            await self._remove(batch)
        return True

    def _key_of(self, name: bytes) -> OffloadKey | None:
        """The key whose value ``name`` is, or None for a name the tier never writes."""
        try:
            return OffloadKey(bytes.fromhex(name.decode("ascii").rpartition("/")[2]))
        except ValueError:
            return None

    async def _remove(self, keys: Sequence[OffloadKey]) -> None:
        async def queue(pipe: _Pipe) -> None:
            for key in keys:
                pipe.delete(self.value_name(key))

        await self._pipeline(queue)
        self._events.add(keys, self.medium, True, self.ctx.tier_name)

    async def _delete(self, keys: Sequence[OffloadKey]) -> Sequence[OffloadKey]:
        """Delete the values of ``keys``; the keys whose value is gone. Never raises."""
        try:
            await self._remove(keys)
        except Exception as exc:
            # A remover never raises: the values fail verification again next time.
            failure = describe_error(exc)
            self._log.warning("delete", "deleting %d value(s) failed: %s", len(keys), failure)
            return []
        return keys

    async def _pipeline(
        self, queue: Callable[[_Pipe], Awaitable[None]], *, deadline: bool = True
    ) -> list[Any]:
        """The answers to the commands ``queue(pipe)`` puts in one pipeline, sent as
        one round trip (per node of a cluster), within the job's deadline unless the
        caller bounds it (``deadline=False``). The commands are queued once a
        connection is the pipeline's, so that only max_connections pipelines' values
        exist at once."""
        client = self._connected()
        with anyio.fail_after(self._deadline_s if deadline else None):
            async with self._limit, client.pipeline(transaction=False) as pipe:
                await queue(pipe)
                answers: list[Any] = await pipe.execute()
        return answers

    def _connected(self) -> Redis | RedisCluster:
        if self._client is None:
            raise RedisUnavailable(f"tier {self.ctx.tier_name} is not started, or closed")
        return self._client

    def take_events(self) -> list[OffloadingEvent]:
        return self._events.take()


def _client(settings: RedisSettings, password: Secret[str] | None) -> Redis | RedisCluster:
    """redis-py's asyncio client for ``settings``; it connects on first use."""
    parts = urllib.parse.urlsplit(settings.url)
    options: dict[str, Any] = {
        "host": parts.hostname,
        "port": parts.port or _DEFAULT_PORT,
        "username": parts.username,
        "password": None if password is None else password.value,
        # The tier's own limit keeps its pipelines to max_connections; the margin is
        # for the client's own exchanges (a cluster's refresh of its slot map), which
        # would fail rather than wait at the pool's limit.
        "max_connections": settings.max_connections + _CLIENT_CONNECTIONS,
        "socket_connect_timeout": settings.connect_timeout_s,
        # No read time-out of its own: each request is bounded by its job's deadline.
        "socket_timeout": None,
        "retry": Retry(NoBackoff(), _RETRIES),
        # RESP2: what every Redis and Valkey speaks, and the same answers from every
        # redis-py (6 and later default to RESP3, which servers before Redis 6 lack).
        "protocol": 2,
    }
    if parts.scheme == "rediss":
        options.update(
            ssl=True,
            ssl_ca_certs=_str(settings.tls_ca_file),
            ssl_certfile=_str(settings.tls_cert_file),
            ssl_keyfile=_str(settings.tls_key_file),
        )
    if settings.cluster:
        return RedisCluster(**options)
    return Redis(db=_database(settings.url), **options)


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)
