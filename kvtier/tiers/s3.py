"""The S3 tier: one verified object per chunk in a bucket of any S3-speaking server.

Layout::

    <prefix>/<model>_<namespace digest>/<key hex>.kvt

Each object has the same form as an fs tier file (see :mod:`kvtier.tiers._format`): a
one-page header (magic, version, key, length, checksums) followed by the chunk's
primary row. S3 makes a PUT visible only once it is complete, so no reader ever sees a
torn object; every load is still verified before the chunk is reported loaded, and an
object that is corrupt, truncated, oversize or foreign is a failed load: deleted,
counted, never served.

Data path: an upload's body is the header and the pinned primary row themselves, two
memoryviews handed to the HTTP client as they are (no joined copy); a download
streams the response into a small header buffer and then straight into the slot.
Objects of ``multipart_threshold`` bytes or more go up as a multipart upload whose
parts are slices of the same row.

Lookups are concurrent HEAD requests, answered from a short-lived cache when it has
the key: ``contains`` (the scheduler's hot path) probes that cache and nothing else.
A store skips the keys that cache knows are there. Any other key goes up with
``If-None-Match: *``: a server with conditional writes (AWS, MinIO, moto) then keeps
the object already there and the upload counts as skipped, at no extra request; a
server without them replaces it with the same bytes. ``head_before_store`` asks with a
HEAD first instead: a HEAD per new chunk cost 15-20% of cascade throughput against a
CPU-bound server on loopback, to save uploads that a cascade rarely repeats (a chunk
found in the tier is promoted, not recomputed and stored again).

Throttling (429, 503 SlowDown), server errors (5xx) and broken or refused connections
are retried with jittered exponential back-off, inside a per-job deadline
(``job_deadline_s``) that ends the job well before the framework's own job timeout;
the job then fails and the chunks are misses.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import random
import re
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
import anyio
import anyio.to_thread
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession
from botocore.exceptions import (
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    SSLError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from kvtier import __version__
from kvtier.errors import ConfigError, KVTierError
from kvtier.keys import OffloadKey
from kvtier.metrics import CounterDef, MetricDefinition
from kvtier.records import EventLog, Medium, OffloadingEvent
from kvtier.tiers._format import HEADER_BYTES, ChunkFormat
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob

__all__ = ["S3Tier", "S3TierError"]

logger = logging.getLogger(__name__)

SUFFIX = ".kvt"
RETRIES = "kvtier_s3_retries"
HEAD_REQUESTS = "kvtier_s3_head_requests"
STORES_SKIPPED = "kvtier_s3_stores_skipped"

MIB = 1 << 20
# Requests in flight per tier, each on its own pooled connection. One S3 connection
# moves some 50-100 MB/s, so 16 can fill a 1 GB/s link to a remote S3; against the
# loopback servers here (CPU-bound, sharing two cores with the client) 4 to 32 were
# within the noise of each other. Each request also costs ~1 ms of Python on the loop.
DEFAULT_MAX_CONCURRENCY = 16
# Objects at least this big go up in parts: a 64 MiB single PUT lost to a reset
# connection costs more to resend than its parts would; 2 MiB chunks stay single PUTs.
DEFAULT_MULTIPART_THRESHOLD = 64 * MIB
DEFAULT_PART_BYTES = 16 * MIB
# S3's limits on a part: at least 5 MiB (except the last), at most 5 GiB.
MIN_PART_BYTES = 5 * MIB
MAX_PART_BYTES = 5 * 1024 * MIB
MAX_PARTS = 10_000
# An S3 object key is at most 1024 bytes of UTF-8.
MAX_OBJECT_KEY_BYTES = 1024
# A connection to a live server on a LAN or in-region opens in milliseconds; botocore's
# 60 s default would let a dead host hold every job for a minute.
DEFAULT_CONNECT_TIMEOUT_S = 2.0
# The longest silence tolerated between two reads of a response: S3 answers first
# bytes within a few hundred ms even under load.
DEFAULT_READ_TIMEOUT_S = 10.0
# Retries of one request after its first attempt; with the back-off below they sleep
# at most 0.1 + 0.2 + 0.4 + 0.8 + 1.6 = 3.1 s, the time S3 asks a throttled client to
# slow down for.
DEFAULT_RETRY_ATTEMPTS = 5
# Every request of a job, retries and back-off included, ends this share of the
# framework's job_timeout_s after the job started (20 s of the default 30 s): the tier
# ends its own requests (and closes their connections) before the framework gives up.
JOB_DEADLINE_SHARE = 2 / 3
# Long enough to answer the scheduler's repeated lookups of one step and the store
# that follows a miss from memory, short enough that another writer's objects are
# seen within a couple of seconds.
DEFAULT_LOOKUP_CACHE_TTL_S = 2.0
# Equal-jitter exponential back-off: attempt n sleeps between half and all of
# min(CAP, BASE * 2**n). Half is fixed so a throttled server really gets a pause; the
# random half keeps retries of one burst from arriving together.
_BACKOFF_BASE_S = 0.1
_BACKOFF_CAP_S = 5.0
# Cached lookup answers beyond this many are dropped oldest first (about 250 bytes
# each); with a 2 s TTL that takes over 100k lookups a second.
_CACHE_MAX_ENTRIES = 1 << 18
# xxh3 runs at ~20 GB/s here and releases the GIL: a checksum of a chunk up to this
# size (under 0.5 ms) runs on the loop; bigger ones go to a thread so the loop keeps
# its timers.
_INLINE_CHECKSUM_BYTES = 8 * MIB
# Aborting a failed multipart upload is best effort; it must not hold up the job.
_ABORT_TIMEOUT_S = 5.0

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_RETRY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
    }
)
_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_MISSING = "missing"
_MODEL_SLUG = re.compile(r"[^A-Za-z0-9._-]+")
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")
_ADDRESSING_STYLES = ("auto", "path", "virtual")
_T = TypeVar("_T")
_Item = TypeVar("_Item")


class S3TierError(KVTierError):
    """An S3 job failed after its retries; the framework counts it as a miss."""


class _Secret:
    """A credential that never shows itself in a repr or a log line."""

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "<secret>"

    __str__ = __repr__


class _Upload(enum.Enum):
    """How an upload ended."""

    DONE = "done"
    #: The server refused to replace the object already there.
    PRESENT = "present"
    #: Another writer was uploading the same object at that moment.
    RACING = "racing"


@dataclass(frozen=True)
class _Failed:
    error: Exception


class S3Tier(SecondaryTier):
    """Chunks as objects in an S3 bucket (AWS, or any S3-speaking server).

    Parameters: ``bucket`` (required); ``endpoint_url`` (none: AWS); ``region``
    (``us-east-1``); ``prefix`` (``""``); ``access_key_id`` / ``secret_access_key`` /
    ``session_token`` (none: the standard AWS credential chain); ``addressing_style``
    (``path`` with an ``endpoint_url``, else ``auto``); ``max_concurrency`` (requests
    in flight, 16; also the connection pool's size); ``multipart_threshold`` (bytes,
    64 MiB) and ``multipart_part_bytes`` (16 MiB); ``connect_timeout_s`` (2) and
    ``read_timeout_s`` (10); ``retry_attempts`` (5); ``job_deadline_s`` (two thirds
    of the tier's ``job_timeout_s``: 20);
    ``lookup_cache_ttl_s`` (2, 0 turns the cache off); ``head_before_store`` (false:
    skip present objects through conditional uploads rather than a HEAD each);
    ``sign_payload`` (false).

    The bucket must exist; :meth:`start` checks that it can be reached and fails
    with a message naming the setting to fix when it cannot.
    """

    medium = Medium.STORAGE
    locality = "remote"

    def __init__(self, ctx: TierContext, **params: Any) -> None:
        super().__init__(ctx)
        settings = ctx.read(params)
        self.bucket: str = settings.string("bucket")
        if not _BUCKET.match(self.bucket):
            raise ConfigError(
                settings.path_of("bucket"),
                "expected a bucket name of 2-255 letters, digits, '.', '_' or '-'",
            )
        self.endpoint_url: str | None = settings.string("endpoint_url", None)
        if self.endpoint_url is not None:
            parts = urlsplit(self.endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(
                    settings.path_of("endpoint_url"), "expected an http:// or https:// URL"
                )
        self.region: str = settings.string("region", "us-east-1")
        prefix = settings.raw("prefix", "")
        if not isinstance(prefix, str):
            raise ConfigError(settings.path_of("prefix"), "expected a string")
        self.prefix = prefix.strip("/")
        access_key_id = settings.string("access_key_id", None, secret=True)
        secret_access_key = settings.string("secret_access_key", None, secret=True)
        session_token = settings.string("session_token", None, secret=True)
        if (access_key_id is None) != (secret_access_key is None):
            missing = "secret_access_key" if secret_access_key is None else "access_key_id"
            raise ConfigError(
                settings.path_of(missing),
                "is required when the other half of the key pair is set",
            )
        if session_token is not None and access_key_id is None:
            raise ConfigError(
                settings.path_of("session_token"),
                "needs access_key_id and secret_access_key",
            )
        self._credentials = {
            name: _Secret(value)
            for name, value in (
                ("aws_access_key_id", access_key_id),
                ("aws_secret_access_key", secret_access_key),
                ("aws_session_token", session_token),
            )
            if value is not None
        }
        self.addressing_style: str = settings.string(
            "addressing_style",
            "path" if self.endpoint_url is not None else "auto",
            choices=_ADDRESSING_STYLES,
        )
        self.max_concurrency: int = settings.integer(
            "max_concurrency", DEFAULT_MAX_CONCURRENCY, minimum=1, maximum=1024
        )
        self.multipart_threshold: int = settings.integer(
            "multipart_threshold", DEFAULT_MULTIPART_THRESHOLD, minimum=1
        )
        self.multipart_part_bytes: int = settings.integer(
            "multipart_part_bytes",
            DEFAULT_PART_BYTES,
            minimum=MIN_PART_BYTES,
            maximum=MAX_PART_BYTES,
        )
        self.connect_timeout_s: float = settings.number(
            "connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S, minimum=0, exclusive_minimum=True
        )
        self.read_timeout_s: float = settings.number(
            "read_timeout_s", DEFAULT_READ_TIMEOUT_S, minimum=0, exclusive_minimum=True
        )
        self.retry_attempts: int = settings.integer(
            "retry_attempts", DEFAULT_RETRY_ATTEMPTS, minimum=0, maximum=50
        )
        self.job_deadline_s: float = settings.number(
            "job_deadline_s",
            ctx.job_timeout_s * JOB_DEADLINE_SHARE,
            minimum=0,
            exclusive_minimum=True,
        )
        if self.job_deadline_s >= ctx.job_timeout_s:
            raise ConfigError(
                settings.path_of("job_deadline_s"),
                f"must be below the tier's job_timeout_s ({ctx.job_timeout_s:g} s), or the "
                "framework gives up on jobs while their requests still run",
            )
        self.lookup_cache_ttl_s: float = settings.number(
            "lookup_cache_ttl_s", DEFAULT_LOOKUP_CACHE_TTL_S, minimum=0
        )
        self.head_before_store: bool = settings.boolean("head_before_store", False)
        self.sign_payload: bool = settings.boolean("sign_payload", False)
        settings.reject_unknown()

        self._format = ChunkFormat(ctx.namespace)
        slug = _MODEL_SLUG.sub("_", ctx.model_name).strip("_")[:64] or "model"
        directory = f"{slug}_{self._format.digest_hex}"
        self.directory = f"{self.prefix}/{directory}" if self.prefix else directory
        self.object_bytes = HEADER_BYTES + ctx.chunk_bytes
        if self.object_bytes >= self.multipart_threshold:
            parts = -(-self.object_bytes // self.multipart_part_bytes)
            if parts > MAX_PARTS:
                raise ConfigError(
                    settings.path_of("multipart_part_bytes"),
                    f"a chunk object of {self.object_bytes} bytes would take {parts} parts; "
                    f"S3 allows {MAX_PARTS}",
                )
        self._label = (ctx.tier_name,)
        self._events = EventLog(ctx.enable_events)
        #: key -> (present, expiry on the monotonic clock), oldest first. Written on
        #: the loop, read by contains() on the scheduler's thread: the lock makes
        #: each probe see a whole entry.
        self._answers: OrderedDict[OffloadKey, tuple[bool, float]] = OrderedDict()
        self._answers_lock = threading.Lock()
        self._random = random.Random()
        self._client: Any = None
        self._exit_stack: contextlib.AsyncExitStack | None = None
        # Bound to the running loop, so start() creates it.
        self._requests: anyio.Semaphore | None = None
        #: Whether uploads of keys the tier knows nothing about carry
        #: "If-None-Match: *"; turned off for a server that answers 501 to it.
        self._conditional_writes = True

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(tier={self.ctx.tier_name!r}, bucket={self.bucket!r}, "
            f"endpoint={_display_url(self.endpoint_url)!r}, directory={self.directory!r})"
        )

    @classmethod
    def build_metric_definitions(
        cls, tier_config: Mapping[str, Any]
    ) -> dict[str, MetricDefinition]:
        return {
            RETRIES: CounterDef(
                "S3 requests retried after throttling, a server error or a broken "
                "connection, by tier.",
                ("tier",),
            ),
            HEAD_REQUESTS: CounterDef(
                "HEAD requests the S3 tier sent to answer lookups (and, with "
                "head_before_store, before uploads), by tier.",
                ("tier",),
            ),
            STORES_SKIPPED: CounterDef(
                "Chunks the S3 tier did not upload because their object was already "
                "there (known from a lookup, a HEAD, or a refused conditional upload), "
                "by tier.",
                ("tier",),
            ),
        }

    # -------------------------------------------------------------- lifecycle

    def create_session(self) -> AioSession:
        """The aiobotocore session the client comes from (override to inject one).

        Runs in a worker thread: building a session and loading botocore's service
        model read files.
        """
        return AioSession()

    async def start(self) -> None:
        self._requests = anyio.Semaphore(self.max_concurrency)
        stack = contextlib.AsyncExitStack()
        try:
            self._client = await stack.enter_async_context(self.open_client())
            await self._check_bucket()
        except BaseException:
            self._client = None
            await stack.aclose()
            raise
        self._exit_stack = stack
        logger.info(
            "tier %s: bucket %s at %s, objects under %s/",
            self.ctx.tier_name,
            self.bucket,
            _display_url(self.endpoint_url),
            self.directory,
        )

    def _prepared_session(self) -> AioSession:
        session = self.create_session()
        # Loading botocore's S3 model and endpoint rules reads and parses files; done
        # here, in a thread, the client is then built on the loop from warm caches.
        loader = session.get_component("data_loader")
        with contextlib.suppress(Exception):
            loader.load_service_model("s3", "service-2")
            loader.load_service_model("s3", "endpoint-rule-set-1")
            loader.load_data("endpoints")
            loader.load_data("partitions")
            loader.load_data("sdk-default-configuration")
            session.full_config  # noqa: B018 - reads the AWS config files once, here
        return session

    @contextlib.asynccontextmanager
    async def open_client(self) -> AsyncIterator[Any]:
        """A new client like the tier's own: endpoint, credentials, configuration.

        The tier's client is one; another shares nothing with it, so it can measure
        what the server gives a plain client (``kvtier bench`` does).
        """
        session = await anyio.to_thread.run_sync(self._prepared_session)
        async with session.create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            config=self.client_config(),
            **{name: secret.value for name, secret in self._credentials.items()},
        ) as client:
            yield client

    def client_config(self) -> AioConfig:
        """The aiobotocore configuration of this tier's client (the benchmark reuses it)."""
        return AioConfig(
            region_name=self.region,
            signature_version="s3v4",
            s3={
                "addressing_style": self.addressing_style,
                # Signing the payload hashes every byte with SHA-256 on the loop
                # (~1.2 ms per 2 MiB here). Each chunk already carries an xxh3 checksum
                # that is verified on every load, so the default sends the body
                # unsigned (SigV4 still signs the request).
                "payload_signing_enabled": self.sign_payload,
            },
            # botocore would otherwise compute a CRC of every body and response on
            # the loop, and not every S3-speaking server understands the headers.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # The pool caps concurrency below botocore: with fewer connections than
            # requests in flight, the rest queue unseen inside aiohttp.
            max_pool_connections=self.max_concurrency,
            connect_timeout=self.connect_timeout_s,
            read_timeout=self.read_timeout_s,
            # This tier retries itself, inside the job's deadline (botocore's retries
            # know no deadline and cannot rebuild a memoryview body).
            retries={"total_max_attempts": 1, "mode": "standard"},
            # A fixed User-Agent: botocore otherwise rebuilds and sanitises its
            # default one, component by component, for every request (~0.15 ms of
            # the ~1 ms of Python each request costs on the loop here).
            user_agent=f"kvtier/{__version__}",
        )

    async def _check_bucket(self) -> None:
        deadline = time.monotonic() + self.job_deadline_s
        try:
            await self._call(deadline, lambda: self._client.head_bucket(Bucket=self.bucket))
        except ClientError as exc:
            status = _status_of(exc)
            path = self.ctx.config_path
            where = f"at {_display_url(self.endpoint_url)}"
            if status == 404:
                raise ConfigError(
                    f"{path}.bucket", f"bucket {self.bucket!r} does not exist {where}"
                ) from None
            if status in (401, 403):
                raise ConfigError(
                    f"{path}.bucket",
                    f"access to bucket {self.bucket!r} {where} was denied (HTTP {status}): "
                    "check the credentials and the bucket policy",
                ) from None
            if status == 301:
                raise ConfigError(
                    f"{path}.region",
                    f"bucket {self.bucket!r} is not in region {self.region!r}",
                ) from None
            raise S3TierError(
                f"tier {self.ctx.tier_name}: bucket {self.bucket!r} {where} answered "
                f"HTTP {status} ({_code_of(exc)})"
            ) from None
        except S3TierError:
            raise
        except Exception as exc:
            raise S3TierError(
                f"tier {self.ctx.tier_name}: cannot reach bucket {self.bucket!r} at "
                f"{_display_url(self.endpoint_url)}: {exc}"
            ) from exc

    async def aclose(self) -> None:
        stack, self._exit_stack = self._exit_stack, None
        self._client = None
        if stack is not None:
            await stack.aclose()

    # ---------------------------------------------------------------- lookups

    def object_key(self, key: OffloadKey) -> str:
        """The name of ``key``'s object in the bucket."""
        return f"{self.directory}/{key.hex()}{SUFFIX}"

    def contains(self, key: OffloadKey) -> bool | None:
        with self._answers_lock:
            entry = self._answers.get(key)
        if entry is None or entry[1] <= time.monotonic():
            return None
        return entry[0]

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        deadline = time.monotonic() + self.job_deadline_s
        answers: dict[OffloadKey, bool] = {}
        unknown: list[OffloadKey] = []
        for key in keys:
            known = self.contains(key)
            if known is None:
                if key not in answers:
                    unknown.append(key)
                    answers[key] = False
            else:
                answers[key] = known
        outcomes = await self._each(unknown, lambda key: self._size_of(key, deadline))
        self.ctx.metrics.inc(HEAD_REQUESTS, len(unknown), self._label)
        failed = [outcome for outcome in outcomes if isinstance(outcome, _Failed)]
        if failed:
            raise S3TierError(
                f"{len(failed)} of {len(unknown)} HEAD requests failed, first: {failed[0].error!r}"
            ) from failed[0].error
        found = [
            (key, size == self.object_bytes) for key, size in zip(unknown, outcomes, strict=True)
        ]
        self._remember(found)
        answers.update(found)
        # An object of the wrong size cannot hold a chunk of this tier: it is corrupt.
        wrong = {
            key: "truncated object" if size < self.object_bytes else "oversize object"
            for key, size in zip(unknown, outcomes, strict=True)
            if isinstance(size, int) and size != self.object_bytes
        }
        if wrong:
            await self._discard(wrong, deadline, f"a lookup of {len(keys)} chunks")
        return [answers[key] for key in keys]

    async def _size_of(self, key: OffloadKey, deadline: float) -> int | None:
        """The size of ``key``'s object, or None when there is none."""
        name = self.object_key(key)
        try:
            response = await self._call(
                deadline, lambda: self._client.head_object(Bucket=self.bucket, Key=name)
            )
        except ClientError as exc:
            if _is_not_found(exc):
                return None
            raise
        size = response.get("ContentLength")
        # A server that does not say leaves the judgement to the load's verification.
        return size if isinstance(size, int) else self.object_bytes

    def forget_answers(self) -> None:
        """Drop every cached lookup answer: the next lookups ask the server."""
        with self._answers_lock:
            self._answers.clear()

    def _remember(self, answers: Iterable[tuple[OffloadKey, bool]]) -> None:
        ttl = self.lookup_cache_ttl_s
        if ttl <= 0:
            return
        now = time.monotonic()
        expiry = now + ttl
        with self._answers_lock:
            cache = self._answers
            for key, present in answers:
                cache[key] = (present, expiry)
                cache.move_to_end(key)
            # One TTL for all: the oldest entry expires first.
            while cache and (
                len(cache) > _CACHE_MAX_ENTRIES or next(iter(cache.values()))[1] <= now
            ):
                cache.popitem(last=False)

    # ----------------------------------------------------------------- stores

    async def store(self, job: TransferJob) -> JobResult:
        deadline = time.monotonic() + self.job_deadline_s
        view = self.ctx.primary_view
        chunks = list(zip(job.keys, job.chunk_ids, strict=True))
        uploaded: list[OffloadKey] = []
        found: list[OffloadKey] = []
        skipped = 0
        heads = 0

        async def store_one(chunk: tuple[OffloadKey, int]) -> None:
            nonlocal skipped, heads
            key, chunk_id = chunk
            present = self.contains(key)
            if present is None and self.head_before_store:
                heads += 1
                # An object of another size is corrupt: the upload replaces it.
                present = await self._size_of(key, deadline) == self.object_bytes
                if present:
                    found.append(key)
            if present:
                skipped += 1
                return
            # A key nobody asked about goes up only if absent; one known to be
            # absent (or corrupt) goes up unconditionally, replacing what is there.
            outcome = await self._upload(key, view[chunk_id], deadline, present is None)
            if outcome is _Upload.DONE:
                uploaded.append(key)
                return
            skipped += 1
            if outcome is _Upload.PRESENT:
                found.append(key)

        try:
            outcomes = await self._each(chunks, store_one)
        finally:
            # Whatever was uploaded is there, even if the job was cut short.
            if uploaded or found:
                self._remember((key, True) for key in (*uploaded, *found))
            self._events.add(uploaded, self.medium, False, self.ctx.tier_name)
            self.ctx.metrics.inc(HEAD_REQUESTS, heads, self._label)
            self.ctx.metrics.inc(STORES_SKIPPED, skipped, self._label)
        failed = [outcome for outcome in outcomes if isinstance(outcome, _Failed)]
        if failed:
            raise S3TierError(
                f"{len(failed)} of {len(chunks)} chunk uploads to bucket {self.bucket!r} "
                f"failed, first: {failed[0].error!r}"
            ) from failed[0].error
        return JobResult(job.job_id, True, transfer_bytes=len(uploaded) * self.ctx.chunk_bytes)

    async def _upload(
        self, key: OffloadKey, row: memoryview, deadline: float, only_if_absent: bool
    ) -> _Upload:
        """Upload ``key``'s object; with ``only_if_absent``, never over an existing one."""
        name = self.object_key(key)
        if len(name.encode()) > MAX_OBJECT_KEY_BYTES:
            raise S3TierError(f"object name {name[:64]}... is longer than S3 allows")
        header = bytearray(HEADER_BYTES)
        if len(row) > _INLINE_CHECKSUM_BYTES:
            await anyio.to_thread.run_sync(self._format.pack_header, header, key, row)
        else:
            self._format.pack_header(header, key, row)
        conditional = only_if_absent and self._conditional_writes
        try:
            await self._send(name, memoryview(header), row, deadline, conditional)
        except ClientError as exc:
            if not conditional:
                raise
            code, status = _code_of(exc), _status_of(exc)
            if status == 412 or code == "PreconditionFailed":
                return _Upload.PRESENT
            if status == 409 or code == "ConditionalRequestConflict":
                return _Upload.RACING  # another writer is storing this very key
            if status != 501 and code != "NotImplemented":
                raise
            if self._conditional_writes:  # concurrent uploads learn it together: say it once
                self._conditional_writes = False
                logger.info(
                    "tier %s: the server does not support conditional writes "
                    "(If-None-Match); uploads replace objects already there",
                    self.ctx.tier_name,
                )
            await self._send(name, memoryview(header), row, deadline, False)
        return _Upload.DONE

    async def _send(
        self, name: str, header: memoryview, row: memoryview, deadline: float, conditional: bool
    ) -> None:
        # "If-None-Match: *" makes a server that supports conditional writes (AWS
        # since 2024, MinIO, moto) refuse to replace an object; others ignore it.
        condition = {"IfNoneMatch": "*"} if conditional else {}
        if self.object_bytes >= self.multipart_threshold:
            await self._upload_parts(name, header, row, deadline, condition)
            return
        await self._call(
            deadline,
            lambda: self._client.put_object(
                Bucket=self.bucket,
                Key=name,
                Body=_Body((header, row)),
                ContentLength=self.object_bytes,
                **condition,
            ),
        )

    async def _upload_parts(
        self,
        name: str,
        header: memoryview,
        row: memoryview,
        deadline: float,
        condition: Mapping[str, str],
    ) -> None:
        created = await self._call(
            deadline,
            lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=name),
        )
        upload_id = created["UploadId"]
        parts = _split_parts(header, row, self.multipart_part_bytes)
        etags: list[str] = [""] * len(parts)

        async def upload_part(number: int) -> None:
            body = parts[number]
            response = await self._call(
                deadline,
                lambda: self._client.upload_part(
                    Bucket=self.bucket,
                    Key=name,
                    UploadId=upload_id,
                    PartNumber=number + 1,
                    Body=_Body(body),
                    ContentLength=sum(len(piece) for piece in body),
                ),
            )
            etags[number] = response["ETag"]

        try:
            outcomes = await self._each(range(len(parts)), upload_part)
            failed = [outcome for outcome in outcomes if isinstance(outcome, _Failed)]
            if failed:
                raise failed[0].error
            manifest = [{"ETag": etag, "PartNumber": i + 1} for i, etag in enumerate(etags)]
            await self._call(
                deadline,
                lambda: self._client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=name,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": manifest},
                    **condition,
                ),
            )
        except BaseException:
            # Parts of an upload never completed are billed storage until aborted.
            with anyio.CancelScope(shield=True), anyio.move_on_after(_ABORT_TIMEOUT_S):
                try:
                    await self._client.abort_multipart_upload(
                        Bucket=self.bucket, Key=name, UploadId=upload_id
                    )
                except Exception as exc:
                    logger.debug("tier %s: aborting %s failed: %r", self.ctx.tier_name, name, exc)
            raise

    # ------------------------------------------------------------------ loads

    async def load(self, job: TransferJob) -> JobResult:
        deadline = time.monotonic() + self.job_deadline_s
        view = self.ctx.primary_view
        chunks = list(zip(job.keys, job.chunk_ids, strict=True))
        outcomes = await self._each(
            chunks, lambda chunk: self._download(chunk[0], view[chunk[1]], deadline)
        )
        loaded: list[OffloadKey] = []
        lost: list[OffloadKey] = []
        corrupt: dict[OffloadKey, str] = {}
        errors: list[Exception] = []
        for (key, _), outcome in zip(chunks, outcomes, strict=True):
            if outcome is None:
                loaded.append(key)
            elif isinstance(outcome, _Failed):
                errors.append(outcome.error)
            else:
                lost.append(key)
                if outcome != _MISSING:
                    corrupt[key] = outcome
        if lost:
            self._remember((key, False) for key in lost)
        if corrupt:
            await self._discard(corrupt, deadline, f"promotion job {job.job_id}")
        if errors:
            summary = (
                f"{len(errors)} of {len(chunks)} chunk downloads from bucket "
                f"{self.bucket!r} failed, first: {errors[0]!r}"
            )
            if not loaded:
                raise S3TierError(summary) from errors[0]
            logger.warning("tier %s: promotion job %d: %s", self.ctx.tier_name, job.job_id, summary)
        return JobResult(job.job_id, not (lost or errors), successful_keys=loaded)

    async def _download(self, key: OffloadKey, row: memoryview, deadline: float) -> str | None:
        """Fetch ``key``'s object into ``row``: None when verified, else what was wrong."""
        name = self.object_key(key)
        header = bytearray(HEADER_BYTES)
        try:
            problem = await self._call(
                deadline, lambda: self._fetch_into(name, memoryview(header), row)
            )
        except ClientError as exc:
            if _is_not_found(exc):
                return _MISSING
            raise
        if problem is not None:
            return problem
        if len(row) > _INLINE_CHECKSUM_BYTES:
            return await anyio.to_thread.run_sync(self._format.verify, header, key, row)
        return self._format.verify(header, key, row)

    async def _fetch_into(self, name: str, header: memoryview, row: memoryview) -> str | None:
        response = await self._client.get_object(Bucket=self.bucket, Key=name)
        body = response["Body"]
        async with body:
            size = response.get("ContentLength")
            if size is not None and size != self.object_bytes:
                return "truncated object" if size < self.object_bytes else "oversize object"
            if await _fill(body, header) < len(header) or await _fill(body, row) < len(row):
                return "truncated object"
            if await body.read(1):
                return "oversize object"
        return None

    async def _discard(self, corrupt: dict[OffloadKey, str], deadline: float, during: str) -> None:
        """Count, delete and log (once) objects found corrupt ``during`` one operation."""
        self.ctx.report_integrity_failure(len(corrupt))

        async def delete(key: OffloadKey) -> None:
            name = self.object_key(key)
            await self._call(
                deadline, lambda: self._client.delete_object(Bucket=self.bucket, Key=name)
            )

        outcomes = await self._each(list(corrupt), delete)
        kept = {
            key
            for key, outcome in zip(corrupt, outcomes, strict=True)
            if isinstance(outcome, _Failed)
        }
        deleted = [key for key in corrupt if key not in kept]
        self._events.add(deleted, self.medium, True, self.ctx.tier_name)
        first = next(iter(corrupt))
        logger.warning(
            "tier %s: %d object(s) failed verification during %s (%s), e.g. s3://%s/%s; "
            "%d deleted, never served",
            self.ctx.tier_name,
            len(corrupt),
            during,
            ", ".join(sorted(set(corrupt.values()))),
            self.bucket,
            self.object_key(first),
            len(deleted),
        )

    # ------------------------------------------------------------------ misc

    def take_events(self) -> list[OffloadingEvent]:
        return self._events.take()

    async def _each(
        self, items: Iterable[_Item], work: Callable[[_Item], Awaitable[_T]]
    ) -> list[_T | _Failed]:
        """Run ``work`` on every item concurrently; each one's result or failure.

        A failure of one item never cancels the others (their bytes are worth
        keeping); the tier-wide semaphore bounds the requests actually in flight.
        """
        todo = list(items)
        results: list[_T | _Failed] = [_Failed(RuntimeError("not run"))] * len(todo)

        async def run(index: int, item: _Item) -> None:
            try:
                results[index] = await work(item)
            except Exception as exc:
                results[index] = _Failed(exc)

        async with anyio.create_task_group() as group:
            for index, item in enumerate(todo):
                group.start_soon(run, index, item)
        return results

    async def _call(self, deadline: float, request: Callable[[], Awaitable[_T]]) -> _T:
        """One S3 request, retried while it fails transiently and time is left.

        Raises the request's last error, or :class:`S3TierError` once ``deadline``
        (monotonic clock) has passed.
        """
        assert self._requests is not None, "the tier has not been started"
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            error: Exception | None = None
            with anyio.move_on_after(remaining) as scope:
                try:
                    async with self._requests:
                        return await request()
                except Exception as exc:
                    error = exc
            if scope.cancel_called or error is None:
                raise S3TierError(
                    f"an S3 request to bucket {self.bucket!r} ran past the job deadline "
                    f"of {self.job_deadline_s:g} s"
                ) from error
            if attempt >= self.retry_attempts or not _is_transient(error):
                raise error
            delay = min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2**attempt)
            delay *= 0.5 + 0.5 * self._random.random()
            if time.monotonic() + delay >= deadline:
                raise error
            attempt += 1
            self.ctx.metrics.inc(RETRIES, 1, self._label)
            logger.debug("tier %s: retrying in %.2f s after %r", self.ctx.tier_name, delay, error)
            await anyio.sleep(delay)


class _Body:
    """A request body sent from memoryviews as they are, never joined into one copy.

    aiohttp streams it through ``__aiter__``. botocore accepts it as a file-like body
    because it has ``read``, which it also uses (with ``seek``/``tell``) to hash the
    payload when ``sign_payload`` is on.
    """

    __slots__ = ("_parts", "_position", "_size")

    def __init__(self, parts: Sequence[memoryview]) -> None:
        self._parts = tuple(parts)
        self._size = sum(len(part) for part in self._parts)
        self._position = 0

    def __len__(self) -> int:
        return self._size

    def __aiter__(self) -> _PartIterator:
        return _PartIterator(self._parts)

    def read(self, size: int = -1) -> bytes:
        start = self._position
        end = self._size if size is None or size < 0 else min(self._size, start + size)
        out = bytearray()
        offset = 0
        for part in self._parts:
            part_end = offset + len(part)
            if part_end > start and offset < end:
                out += part[max(start, offset) - offset : min(end, part_end) - offset]
            offset = part_end
        self._position = end if end > start else start
        return bytes(out)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: self._size}[whence]
        self._position = max(0, min(self._size, base + offset))
        return self._position

    def tell(self) -> int:
        return self._position


class _PartIterator:
    __slots__ = ("_parts",)

    def __init__(self, parts: tuple[memoryview, ...]) -> None:
        self._parts = list(reversed(parts))

    def __aiter__(self) -> _PartIterator:
        return self

    async def __anext__(self) -> memoryview:
        if not self._parts:
            raise StopAsyncIteration
        return self._parts.pop()


def _split_parts(header: memoryview, row: memoryview, part_bytes: int) -> list[list[memoryview]]:
    """The multipart parts of header + row: views of ``part_bytes`` (the last shorter)."""
    first = part_bytes - len(header)
    rest = [[row[start : start + part_bytes]] for start in range(first, len(row), part_bytes)]
    return [[header, row[:first]], *rest]


async def _fill(body: Any, target: memoryview) -> int:
    """Read from a response body into ``target`` until it is full or the body ends."""
    filled = 0
    while filled < len(target):
        # read(n) hands over what the connection has buffered, up to n bytes: a
        # transient piece, copied into place at once.
        piece = await body.read(len(target) - filled)
        if not piece:
            break
        target[filled : filled + len(piece)] = piece
        filled += len(piece)
    return filled


def _status_of(exc: ClientError) -> int | None:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def _code_of(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _is_not_found(exc: ClientError) -> bool:
    return _status_of(exc) == 404 or _code_of(exc) in _NOT_FOUND_CODES


def _is_transient(exc: BaseException) -> bool:
    """Whether a failed request may succeed if sent again."""
    if isinstance(exc, ClientError):
        return _status_of(exc) in _RETRY_STATUS or _code_of(exc) in _RETRY_CODES
    if isinstance(exc, SSLError):
        return False  # a certificate problem does not fix itself
    return isinstance(
        exc,
        (
            BotoConnectionError,
            HTTPClientError,
            IncompleteReadError,
            aiohttp.ClientError,
            ConnectionError,
            TimeoutError,
        ),
    )


def _display_url(url: str | None) -> str:
    """An endpoint as logs and messages may show it: no user info, path or query."""
    if url is None:
        return "AWS"
    parts = urlsplit(url)
    host = parts.hostname or "?"
    return f"{parts.scheme}://{host}:{parts.port}" if parts.port else f"{parts.scheme}://{host}"
