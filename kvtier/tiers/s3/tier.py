"""The S3 tier: one verified object per chunk in a bucket of any S3-speaking server.

Layout (see :mod:`kvtier.format`)::

    <prefix>/<model>_<namespace digest>/<key hex>.kvt

Each object has the same form as an fs tier file (see :mod:`kvtier.format`): a
one-page header (magic, version, key, length, checksums) followed by the chunk's
primary row. S3 makes a PUT visible only once it is complete, so no reader ever sees a
torn object (SeaweedFS keeps an empty one where a PUT's connection closed before its
body began: the client sends bodies at once, see :mod:`kvtier.tiers.s3.client`);
every load is still verified before the chunk is reported loaded, and an object that
is corrupt, truncated, empty, oversize or foreign is a failed load: deleted, counted,
never served.

Lookups are concurrent HEAD requests, answered from a short-lived cache when it has
the key: ``contains`` (the scheduler's hot path) probes that cache and nothing else.
A store skips the keys that cache knows are there. Any other key goes up with
``If-None-Match: *``: a server with conditional writes (AWS, MinIO, SeaweedFS, moto)
then keeps the object already there and the upload counts as skipped, at no extra
request; a server without them replaces it with the same bytes.
``head_before_store`` asks with a HEAD first instead: a HEAD per new chunk cost 15-20%
of cascade throughput against a CPU-bound server on loopback, to save uploads that a
cascade rarely repeats (a chunk found in the tier is promoted, not recomputed and
stored again).

Requests, their retries and the job deadline are the client's
(:mod:`kvtier.tiers.s3.client`); this module decides what to ask for.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import anyio.to_thread
from aiobotocore.session import AioSession

from kvtier.format import (
    HEADER_BYTES,
    MISSING,
    ChunkFormat,
    chunk_name,
    key_of,
    namespace_directory,
)
from kvtier.keys import OffloadKey
from kvtier.metrics import CounterDef, MetricDefinition
from kvtier.records import Locality, Medium, OffloadingEvent
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob
from kvtier.tiers.kit import CorruptChunks, EventLog, ThrottledLog, describe_error
from kvtier.tiers.s3.client import Failed, S3Client, S3TierError, Upload, each
from kvtier.tiers.s3.settings import S3Settings, display_url

__all__ = ["S3Tier"]

logger = logging.getLogger(__name__)

RETRIES = "kvtier_s3_retries"
HEAD_REQUESTS = "kvtier_s3_head_requests"
STORES_SKIPPED = "kvtier_s3_stores_skipped"

# Cached lookup answers beyond this many are dropped oldest first (about 250 bytes
# each); with a 2 s TTL that takes over 100k lookups a second.
_CACHE_MAX_ENTRIES = 1 << 18
# xxh3 runs at ~20 GB/s here and releases the GIL: a checksum of a chunk up to this
# size (under 0.5 ms) runs on the loop; bigger ones go to a thread so the loop keeps
# its timers.
_INLINE_CHECKSUM_BYTES = 8 * (1 << 20)


class S3Tier(SecondaryTier):
    """Chunks as objects in an S3 bucket (AWS, or any S3-speaking server).

    Built from its effective :class:`~kvtier.tiers.s3.settings.S3Settings`
    (:meth:`effective_settings`). The bucket must exist; :meth:`start` checks that it
    can be reached and fails with a message naming the setting to fix when it cannot.
    """

    # Object storage: vLLM's own object-store tier reports its hits as disk ones too.
    medium = Medium.STORAGE
    locality = Locality.REMOTE
    settings_class = S3Settings

    def __init__(self, ctx: TierContext, settings: S3Settings) -> None:
        super().__init__(ctx)
        # Filled in by effective_settings, from which the framework builds the tier.
        assert settings.object_bytes is not None and settings.job_deadline_s is not None
        self.settings = settings
        self.object_bytes = settings.object_bytes
        self._format = ChunkFormat(ctx.namespace)
        directory = namespace_directory(ctx.model_name, self._format)
        prefix = self.settings.prefix
        self.directory = f"{prefix}/{directory}" if prefix else directory
        self._label = (ctx.tier_name,)
        self.client = S3Client(
            self.settings,
            object_bytes=self.object_bytes,
            job_deadline_s=settings.job_deadline_s,
            label=f"tier {ctx.tier_name}",
            config_path=ctx.config_path,
            on_retry=self._count_retry,
            session_factory=self.create_session,
        )
        self._events = EventLog(ctx.enable_events)
        self._log = ThrottledLog(logger, f"tier {ctx.tier_name}")
        self._corrupt = CorruptChunks(ctx, self._log, self._url_of)
        #: key -> (present, expiry on the monotonic clock), oldest first. Written on
        #: the loop, read by contains() on the scheduler's thread: the lock makes
        #: each probe see a whole entry.
        self._answers: OrderedDict[OffloadKey, tuple[bool, float]] = OrderedDict()
        self._answers_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(tier={self.ctx.tier_name!r}, bucket={self.bucket!r}, "
            f"endpoint={display_url(self.settings.endpoint_url)!r}, "
            f"directory={self.directory!r})"
        )

    # The settings kvtier bench reads from the tier it measures.
    @property
    def bucket(self) -> str:
        return self.settings.bucket

    @property
    def prefix(self) -> str:
        return self.settings.prefix

    @property
    def max_concurrency(self) -> int:
        return self.settings.max_concurrency

    @classmethod
    def effective_settings(
        cls, settings: Any, *, chunk_bytes: int, job_timeout_s: float, path: str
    ) -> S3Settings:
        """The settings with ``job_deadline_s`` as the tier derives it from
        ``job_timeout_s`` and the size of its chunk objects (checked against S3's part
        limit)."""
        given: S3Settings = settings
        return given.for_engine(chunk_bytes=chunk_bytes, job_timeout_s=job_timeout_s, path=path)

    @classmethod
    def build_metric_definitions(cls, settings: Any) -> dict[str, MetricDefinition]:
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
        await self.client.open()
        logger.info(
            "tier %s: bucket %s at %s, objects under %s/",
            self.ctx.tier_name,
            self.bucket,
            display_url(self.settings.endpoint_url),
            self.directory,
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    @contextlib.asynccontextmanager
    async def open_client(self) -> AsyncIterator[Any]:
        """A new aiobotocore client like the tier's own: endpoint, credentials, config.

        It shares nothing with the tier's, so it can measure what the server gives a
        plain client (``kvtier bench`` does).
        """
        async with self.client.connect() as client:
            yield client

    def _count_retry(self) -> None:
        self.ctx.metrics.inc(RETRIES, 1, self._label)

    # ---------------------------------------------------------------- lookups

    def object_key(self, key: OffloadKey) -> str:
        """The name of ``key``'s object in the bucket."""
        return f"{self.directory}/{chunk_name(key)}"

    def _url_of(self, key: OffloadKey) -> str:
        return self.client.url_of(self.object_key(key))

    def contains(self, key: OffloadKey) -> bool | None:
        with self._answers_lock:
            entry = self._answers.get(key)
        if entry is None or entry[1] <= time.monotonic():
            return None
        return entry[0]

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        deadline = self.client.deadline()
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
        outcomes = await each(unknown, lambda key: self.client.head(self.object_key(key), deadline))
        self.ctx.metrics.inc(HEAD_REQUESTS, len(unknown), self._label)
        failed = [outcome for outcome in outcomes if isinstance(outcome, Failed)]
        if failed:
            raise S3TierError(
                f"{len(failed)} of {len(unknown)} HEAD requests failed, "
                f"first: {describe_error(failed[0].error)}"
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
        await self._discard(wrong, deadline, f"a lookup of {len(keys)} chunks")
        return [answers[key] for key in keys]

    def forget_answers(self) -> None:
        """Drop every cached lookup answer: the next lookups ask the server."""
        with self._answers_lock:
            self._answers.clear()

    def _remember(self, answers: Iterable[tuple[OffloadKey, bool]]) -> None:
        ttl = self.settings.lookup_cache_ttl_s
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
        deadline = self.client.deadline()
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
            if present is None and self.settings.head_before_store:
                heads += 1
                # An object of another size is corrupt: the upload replaces it.
                size = await self.client.head(self.object_key(key), deadline)
                present = size == self.object_bytes
                if present:
                    found.append(key)
            if present:
                skipped += 1
                return
            # A key nobody asked about goes up only if absent; one known to be
            # absent (or corrupt) goes up unconditionally, replacing what is there.
            outcome = await self._upload(key, view[chunk_id], deadline, present is None)
            if outcome is Upload.DONE:
                uploaded.append(key)
                return
            skipped += 1
            if outcome is Upload.PRESENT:
                found.append(key)

        try:
            outcomes = await each(chunks, store_one)
        finally:
            # Whatever was uploaded is there, even if the job was cut short.
            if uploaded or found:
                self._remember((key, True) for key in (*uploaded, *found))
            self._events.add(uploaded, self.medium, False, self.ctx.tier_name)
            self.ctx.metrics.inc(HEAD_REQUESTS, heads, self._label)
            self.ctx.metrics.inc(STORES_SKIPPED, skipped, self._label)
        failed = [outcome for outcome in outcomes if isinstance(outcome, Failed)]
        if failed:
            raise S3TierError(
                f"{len(failed)} of {len(chunks)} chunk uploads to bucket {self.bucket!r} "
                f"failed, first: {describe_error(failed[0].error)}"
            ) from failed[0].error
        return JobResult(job.job_id, True, transfer_bytes=len(uploaded) * self.ctx.chunk_bytes)

    async def _upload(
        self, key: OffloadKey, row: memoryview, deadline: float, only_if_absent: bool
    ) -> Upload:
        header = bytearray(HEADER_BYTES)
        if len(row) > _INLINE_CHECKSUM_BYTES:
            await anyio.to_thread.run_sync(self._format.pack_header, header, key, row)
        else:
            self._format.pack_header(header, key, row)
        return await self.client.put(
            self.object_key(key), memoryview(header), row, deadline, only_if_absent=only_if_absent
        )

    # ------------------------------------------------------------------ loads

    async def load(self, job: TransferJob) -> JobResult:
        deadline = self.client.deadline()
        view = self.ctx.primary_view
        chunks = list(zip(job.keys, job.chunk_ids, strict=True))
        outcomes = await each(
            chunks, lambda chunk: self._download(chunk[0], view[chunk[1]], deadline)
        )
        loaded: list[OffloadKey] = []
        lost: list[OffloadKey] = []
        corrupt: dict[OffloadKey, str] = {}
        errors: list[Exception] = []
        for (key, _), outcome in zip(chunks, outcomes, strict=True):
            if outcome is None:
                loaded.append(key)
            elif isinstance(outcome, Failed):
                errors.append(outcome.error)
            else:
                lost.append(key)
                if outcome != MISSING:
                    corrupt[key] = outcome
        if lost:
            self._remember((key, False) for key in lost)
        await self._discard(corrupt, deadline, f"promotion job {job.job_id}")
        if errors:
            summary = (
                f"{len(errors)} of {len(chunks)} chunk downloads from bucket "
                f"{self.bucket!r} failed, first: {describe_error(errors[0])}"
            )
            if not loaded:
                raise S3TierError(summary) from errors[0]
            self._log.warning("download", "promotion job %d: %s", job.job_id, summary)
        return JobResult(job.job_id, not (lost or errors), successful_keys=loaded)

    async def _download(self, key: OffloadKey, row: memoryview, deadline: float) -> str | None:
        """Fetch ``key``'s object into ``row``: None when verified, else what was wrong."""
        header = bytearray(HEADER_BYTES)
        problem = await self.client.get_into(
            self.object_key(key), memoryview(header), row, deadline
        )
        if problem is not None:
            return problem
        if len(row) > _INLINE_CHECKSUM_BYTES:
            return await anyio.to_thread.run_sync(self._format.verify, header, key, row)
        return self._format.verify(header, key, row)

    async def _discard(self, corrupt: dict[OffloadKey, str], deadline: float, during: str) -> None:
        """Count, delete and log (once) objects found corrupt ``during`` one operation."""
        await self._corrupt.discard(corrupt, during, lambda keys: self._delete(keys, deadline))

    async def _delete(self, keys: Sequence[OffloadKey], deadline: float) -> list[OffloadKey]:
        outcomes = await each(keys, lambda key: self.client.delete(self.object_key(key), deadline))
        deleted = [
            key
            for key, outcome in zip(keys, outcomes, strict=True)
            if not isinstance(outcome, Failed)
        ]
        self._events.add(deleted, self.medium, True, self.ctx.tier_name)
        return deleted

    async def clear(self) -> bool:
        """Delete every chunk object under the namespace's prefix (engines sharing the
        bucket and prefix lose them too)."""
        deadline = self.client.deadline()
        names = await self.client.list_names(f"{self.directory}/", deadline)
        keys = [key for name in names if (key := key_of(name.rpartition("/")[2])) is not None]
        deleted = await self._delete(keys, deadline)
        self.forget_answers()
        return len(deleted) == len(keys)

    # ------------------------------------------------------------------ misc

    def take_events(self) -> list[OffloadingEvent]:
        return self._events.take()
