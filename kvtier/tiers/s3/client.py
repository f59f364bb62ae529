"""The s3 tier's client: requests to one bucket, retried inside a job's deadline.

:class:`S3Client` wraps one aiobotocore client. Every request goes through
:meth:`S3Client.call`, which bounds the requests in flight, retries what may succeed
when sent again (throttling, 5xx, a broken or refused connection) with jittered
exponential back-off, and gives up at the job's deadline: a failing server costs a job
at most ``job_deadline_s``, never a hang.

Bodies are never joined into one copy: an upload's body is the header and the pinned
primary row themselves (:class:`RequestBody`); a download streams the response into
a small header buffer and then straight into the slot. Objects of
``multipart_threshold`` bytes or more go up as a multipart upload whose parts are
slices of the same row.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

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
from botocore.handlers import add_expect_header

from kvtier import __version__
from kvtier.errors import ConfigError, KVTierError
from kvtier.format import MISSING
from kvtier.resources import AsyncResource
from kvtier.tiers.kit import describe_error
from kvtier.tiers.s3.body import RequestBody, fill, split_parts
from kvtier.tiers.s3.settings import S3Settings, display_url

__all__ = ["Failed", "S3Client", "S3TierError", "Upload", "each"]

logger = logging.getLogger(__name__)

# An S3 object key is at most 1024 bytes of UTF-8.
MAX_OBJECT_KEY_BYTES = 1024
# Equal-jitter exponential back-off: attempt n sleeps between half and all of
# min(CAP, BASE * 2**n). Half is fixed so a throttled server really gets a pause; the
# random half keeps retries of one burst from arriving together.
_BACKOFF_BASE_S = 0.1
_BACKOFF_CAP_S = 5.0
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
_T = TypeVar("_T")
_Item = TypeVar("_Item")


class S3TierError(KVTierError):
    """An S3 job failed after its retries; the framework counts it as a miss."""


class Upload(enum.Enum):
    """How an upload ended."""

    DONE = "done"
    #: The server refused to replace the object already there.
    PRESENT = "present"
    #: Another writer was uploading the same object at that moment.
    RACING = "racing"


@dataclass(frozen=True)
class Failed:
    """The failure of one item of :func:`each`."""

    error: Exception


async def each(items: Iterable[_Item], work: Callable[[_Item], Awaitable[_T]]) -> list[_T | Failed]:
    """Run ``work`` on every item concurrently; each one's result or :class:`Failed`.

    A failure of one item never cancels the others (their bytes are worth keeping);
    the client's semaphore bounds the requests actually in flight. Every item has
    ended when this returns, or when it raises because its own task was cancelled.
    """

    async def run(item: _Item) -> _T | Failed:
        try:
            return await work(item)
        except Exception as exc:
            return Failed(exc)

    return list(await asyncio.gather(*(run(item) for item in items)))


class S3Client(AsyncResource):
    """One tier's connection to its bucket.

    ``object_bytes`` is the size of every chunk object; ``job_deadline_s`` bounds
    the requests of one job, retries included (:meth:`deadline`). ``label`` starts
    log lines; ``config_path`` names the settings that :meth:`open`'s errors blame.
    ``on_retry`` is called once per retried request (the tier counts them).
    ``session_factory`` builds the aiobotocore session; it runs in a worker thread.
    """

    def __init__(
        self,
        settings: S3Settings,
        *,
        object_bytes: int,
        job_deadline_s: float,
        label: str = "s3",
        config_path: str = "secondary_tiers[0]",
        on_retry: Callable[[], None] = lambda: None,
        session_factory: Callable[[], AioSession] = AioSession,
    ) -> None:
        self.settings = settings
        self.object_bytes = object_bytes
        self.job_deadline_s = job_deadline_s
        self._label = label
        self._config_path = config_path
        self._on_retry = on_retry
        self._session_factory = session_factory
        self._random = random.Random()
        self._requests = asyncio.Semaphore(settings.max_concurrency)
        self._client: Any = None
        self._exit_stack: contextlib.AsyncExitStack | None = None
        #: Whether uploads that must not replace an object carry "If-None-Match: *";
        #: turned off for a server that answers 501 to it.
        self.conditional_writes = True

    # -------------------------------------------------------------- lifecycle

    def deadline(self) -> float:
        """The deadline of a job starting now, on the monotonic clock."""
        return time.monotonic() + self.job_deadline_s

    async def open(self) -> None:
        """Connect and check that the bucket can be reached.

        Raises:
            ConfigError: the bucket does not exist, access is denied, or it is in
                another region (named by its setting).
            S3TierError: the server cannot be reached or answers otherwise.
        """
        stack = contextlib.AsyncExitStack()
        try:
            self._client = await stack.enter_async_context(self.connect())
            await self._check_bucket()
        except BaseException:
            self._client = None
            await stack.aclose()
            raise
        self._exit_stack = stack

    async def aclose(self) -> None:
        stack, self._exit_stack = self._exit_stack, None
        self._client = None
        if stack is not None:
            await stack.aclose()

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[Any]:
        """A new aiobotocore client with these settings: endpoint, credentials, config.

        The client's own is one; another shares nothing with it, so it can measure
        what the server gives a plain client (``kvtier bench`` does).
        """
        session = await anyio.to_thread.run_sync(self._prepared_session)
        async with session.create_client(
            "s3",
            endpoint_url=self.settings.endpoint_url,
            region_name=self.settings.region,
            config=self.aio_config(),
            # None: botocore verifies https endpoints against the system's authorities.
            verify=self.settings.ca_bundle,
            **self.settings.credentials(),
        ) as client:
            # botocore asks to "Expect: 100-continue" before every body it can read,
            # and holds the body back until the server answers. SeaweedFS stores an
            # empty object when a PUT's connection closes after its headers and before
            # any body byte, so a job cut short in that wait (a deadline, a stalled
            # server) would leave one under the chunk's name, refusing the next
            # conditional upload. Sent at once, a body cut short leaves nothing, and
            # an upload saves a round trip; a refused one sends its body for nothing,
            # which the lookup cache keeps rare.
            client.meta.events.unregister("before-call.s3", add_expect_header)
            yield client

    def _prepared_session(self) -> AioSession:
        session = self._session_factory()
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

    def aio_config(self) -> AioConfig:
        """The aiobotocore configuration of this client (the benchmark reuses it)."""
        settings = self.settings
        return AioConfig(
            region_name=settings.region,
            signature_version="s3v4",
            s3={
                "addressing_style": settings.addressing_style,
                # Signing the payload hashes every byte with SHA-256 on the loop
                # (~1.2 ms per 2 MiB here). Each chunk already carries an xxh3 checksum
                # that is verified on every load, so the default sends the body
                # unsigned (SigV4 still signs the request).
                "payload_signing_enabled": settings.sign_payload,
            },
            # botocore would otherwise compute a CRC of every body and response on
            # the loop, and not every S3-speaking server understands the headers.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # The pool caps concurrency below botocore: with fewer connections than
            # requests in flight, the rest queue unseen inside aiohttp.
            max_pool_connections=settings.max_concurrency,
            connect_timeout=settings.connect_timeout_s,
            read_timeout=settings.read_timeout_s,
            # This client retries itself, inside the job's deadline (botocore's
            # retries know no deadline and cannot rebuild a memoryview body).
            retries={"total_max_attempts": 1, "mode": "standard"},
            # A fixed User-Agent: botocore otherwise rebuilds and sanitises its
            # default one, component by component, for every request (~0.15 ms of
            # the ~1 ms of Python each request costs on the loop here).
            user_agent=f"kvtier/{__version__}",
        )

    async def _check_bucket(self) -> None:
        bucket = self.settings.bucket
        where = f"at {display_url(self.settings.endpoint_url)}"
        path = self._config_path
        try:
            await self.call(self.deadline(), lambda: self._client.head_bucket(Bucket=bucket))
        except ClientError as exc:
            status = _status_of(exc)
            if status == 404:
                raise ConfigError(
                    f"{path}.bucket", f"bucket {bucket!r} does not exist {where}"
                ) from None
            if status in (401, 403):
                raise ConfigError(
                    f"{path}.bucket",
                    f"access to bucket {bucket!r} {where} was denied (HTTP {status}): "
                    "check the credentials and the bucket policy",
                ) from None
            if status == 301:
                raise ConfigError(
                    f"{path}.region",
                    f"bucket {bucket!r} is not in region {self.settings.region!r}",
                ) from None
            raise S3TierError(
                f"{self._label}: bucket {bucket!r} {where} answered HTTP {status} ({_code_of(exc)})"
            ) from None
        except S3TierError:
            raise
        except Exception as exc:
            raise S3TierError(
                f"{self._label}: cannot reach bucket {bucket!r} {where}: {exc}"
            ) from exc

    # --------------------------------------------------------------- requests

    def url_of(self, name: str) -> str:
        """``s3://bucket/name``, for log lines."""
        return f"s3://{self.settings.bucket}/{name}"

    async def head(self, name: str, deadline: float) -> int | None:
        """The size of object ``name``, or None when there is none."""
        try:
            response = await self.call(
                deadline,
                lambda: self._client.head_object(Bucket=self.settings.bucket, Key=name),
            )
        except ClientError as exc:
            if _is_not_found(exc):
                return None
            raise
        size = response.get("ContentLength")
        # A server that does not say leaves the judgement to the load's verification.
        return size if isinstance(size, int) else self.object_bytes

    async def get_into(
        self, name: str, header: memoryview, row: memoryview, deadline: float
    ) -> str | None:
        """Read object ``name`` into ``header`` + ``row``, unverified.

        Returns None when the object filled both exactly, ``MISSING`` when there is
        no object, else what is wrong with its length.
        """
        try:
            return await self.call(deadline, lambda: self._fetch_into(name, header, row))
        except ClientError as exc:
            if _is_not_found(exc):
                return MISSING
            raise

    async def _fetch_into(self, name: str, header: memoryview, row: memoryview) -> str | None:
        response = await self._client.get_object(Bucket=self.settings.bucket, Key=name)
        body = response["Body"]
        async with body:
            size = response.get("ContentLength")
            if size is not None and size != self.object_bytes:
                return "truncated object" if size < self.object_bytes else "oversize object"
            if await fill(body, header) < len(header) or await fill(body, row) < len(row):
                return "truncated object"
            if await body.read(1):
                return "oversize object"
        return None

    async def list_names(
        self, prefix: str, deadline: float, *, page_size: int | None = None
    ) -> list[str]:
        """The names of every object under ``prefix``, all pages of the listing
        (``page_size`` names a page at most; None: the server's own, 1000 on S3)."""
        names: list[str] = []
        request: dict[str, Any] = {"Bucket": self.settings.bucket, "Prefix": prefix}
        if page_size is not None:
            request["MaxKeys"] = page_size
        while True:
            response = await self.call(deadline, functools.partial(self._list_page, dict(request)))
            names.extend(item["Key"] for item in response.get("Contents", ()))
            token = response.get("NextContinuationToken")
            if not response.get("IsTruncated") or not token:
                return names
            request["ContinuationToken"] = token

    async def _list_page(self, request: dict[str, Any]) -> Any:
        return await self._client.list_objects_v2(**request)

    async def delete(self, name: str, deadline: float) -> None:
        await self.call(
            deadline,
            lambda: self._client.delete_object(Bucket=self.settings.bucket, Key=name),
        )

    async def put(
        self,
        name: str,
        header: memoryview,
        row: memoryview,
        deadline: float,
        *,
        only_if_absent: bool,
    ) -> Upload:
        """Upload ``header`` + ``row`` as object ``name``.

        With ``only_if_absent`` the upload asks the server not to replace an object
        already there; a server without conditional writes replaces it anyway (said
        once in the log, and later uploads go without the condition).
        """
        if len(name.encode()) > MAX_OBJECT_KEY_BYTES:
            raise S3TierError(f"object name {name[:64]}... is longer than S3 allows")
        conditional = only_if_absent and self.conditional_writes
        try:
            await self._send(name, header, row, deadline, conditional)
        except ClientError as exc:
            if not conditional:
                raise
            code, status = _code_of(exc), _status_of(exc)
            if status == 412 or code == "PreconditionFailed":
                return Upload.PRESENT
            if status == 409 or code == "ConditionalRequestConflict":
                return Upload.RACING  # another writer is storing this very key
            if status != 501 and code != "NotImplemented":
                raise
            if self.conditional_writes:  # concurrent uploads learn it together: say it once
                self.conditional_writes = False
                logger.info(
                    "%s: the server does not support conditional writes "
                    "(If-None-Match); uploads replace objects already there",
                    self._label,
                )
            await self._send(name, header, row, deadline, False)
        return Upload.DONE

    async def _send(
        self, name: str, header: memoryview, row: memoryview, deadline: float, conditional: bool
    ) -> None:
        # "If-None-Match: *" makes a server that supports conditional writes (AWS
        # since 2024, MinIO, SeaweedFS, moto) refuse to replace an object; others
        # ignore it.
        condition = {"IfNoneMatch": "*"} if conditional else {}
        if len(header) + len(row) >= self.settings.multipart_threshold:
            await self._upload_parts(name, header, row, deadline, condition)
            return
        await self.call(
            deadline,
            lambda: self._client.put_object(
                Bucket=self.settings.bucket,
                Key=name,
                Body=RequestBody((header, row)),
                ContentLength=len(header) + len(row),
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
        bucket = self.settings.bucket
        created = await self.call(
            deadline, lambda: self._client.create_multipart_upload(Bucket=bucket, Key=name)
        )
        upload_id = created["UploadId"]
        parts = split_parts(header, row, self.settings.multipart_part_bytes)

        async def upload_part(number: int) -> str:
            body = parts[number]
            response = await self.call(
                deadline,
                lambda: self._client.upload_part(
                    Bucket=bucket,
                    Key=name,
                    UploadId=upload_id,
                    PartNumber=number + 1,
                    Body=RequestBody(body),
                    ContentLength=sum(len(piece) for piece in body),
                ),
            )
            return str(response["ETag"])

        try:
            etags = await each(range(len(parts)), upload_part)
            for etag in etags:
                if isinstance(etag, Failed):
                    raise etag.error
            manifest = [{"ETag": etag, "PartNumber": i + 1} for i, etag in enumerate(etags)]
            await self.call(
                deadline,
                lambda: self._client.complete_multipart_upload(
                    Bucket=bucket,
                    Key=name,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": manifest},
                    **condition,
                ),
            )
        except BaseException:
            # Parts of an upload never completed are billed storage until aborted.
            # anyio's shielded scope finishes the abort in this task, bounded, before
            # a cancellation goes on; asyncio.shield would leave it running unowned.
            with anyio.CancelScope(shield=True), anyio.move_on_after(_ABORT_TIMEOUT_S):
                try:
                    await self._client.abort_multipart_upload(
                        Bucket=bucket, Key=name, UploadId=upload_id
                    )
                except Exception as exc:
                    logger.debug(
                        "%s: aborting %s failed: %s", self._label, name, describe_error(exc)
                    )
            raise

    async def call(self, deadline: float, request: Callable[[], Awaitable[_T]]) -> _T:
        """One S3 request, retried while it fails transiently and time is left.

        Raises the request's last error, or :class:`S3TierError` once ``deadline``
        (monotonic clock) has passed.
        """
        if self._client is None:
            raise RuntimeError(f"{self._label}: the S3 client is not open")
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            error: Exception | None = None
            # A cancel scope bounds the request inside this task; asyncio.wait_for
            # runs it in a task of its own before Python 3.12, which may still write
            # into a slot for one loop iteration after the timeout.
            with anyio.move_on_after(remaining) as scope:
                try:
                    async with self._requests:
                        return await request()
                except Exception as exc:
                    error = exc
            if scope.cancel_called or error is None:
                raise S3TierError(
                    f"an S3 request to bucket {self.settings.bucket!r} ran past the job "
                    f"deadline of {self.job_deadline_s:g} s"
                ) from error
            if attempt >= self.settings.retry_attempts or not is_transient(error):
                raise error
            delay = min(_BACKOFF_CAP_S, _BACKOFF_BASE_S * 2**attempt)
            delay *= 0.5 + 0.5 * self._random.random()
            if time.monotonic() + delay >= deadline:
                raise error
            attempt += 1
            self._on_retry()
            logger.debug(
                "%s: retrying in %.2f s after %s", self._label, delay, describe_error(error)
            )
            await asyncio.sleep(delay)


def _status_of(exc: ClientError) -> int | None:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else None


def _code_of(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _is_not_found(exc: ClientError) -> bool:
    return _status_of(exc) == 404 or _code_of(exc) in _NOT_FOUND_CODES


def is_transient(exc: BaseException) -> bool:
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
