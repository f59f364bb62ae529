"""The s3 tier's parameters, parsed and checked before anything is built."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from kvtier.format import HEADER_BYTES
from kvtier.tiers.kit import (
    ConfigError,
    ConfigReader,
    Secret,
    derived_field,
    job_deadline_s,
    read_secret,
)

__all__ = ["S3Settings", "display_url"]

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
# A connection to a live server on a LAN or in-region opens in milliseconds; botocore's
# 60 s default would let a dead host hold every job for a minute.
DEFAULT_CONNECT_TIMEOUT_S = 2.0
# The longest silence tolerated between two reads of a response: S3 answers first
# bytes within a few hundred ms even under load.
DEFAULT_READ_TIMEOUT_S = 10.0
# Retries of one request after its first attempt; with the client's back-off they
# sleep at most 0.1 + 0.2 + 0.4 + 0.8 + 1.6 = 3.1 s, the time S3 asks a throttled
# client to slow down for.
DEFAULT_RETRY_ATTEMPTS = 5
# Long enough to answer the scheduler's repeated lookups of one step and the store
# that follows a miss from memory, short enough that another writer's objects are
# seen within a couple of seconds.
DEFAULT_LOOKUP_CACHE_TTL_S = 2.0
# Beyond these, a value is a typo rather than a tuning.
_MAX_CONCURRENCY = 1024
_MAX_RETRY_ATTEMPTS = 50
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")
_ADDRESSING_STYLES = ("auto", "path", "virtual")


@dataclass(frozen=True)
class S3Settings:
    """The s3 tier's parameters (``{"type": "s3", "bucket": ...}``).

    Credentials are :class:`~kvtier.tiers.kit.Secret`: no repr, log line or error
    message shows them. :meth:`for_engine` fills in what the tier derives from the
    engine (``job_deadline_s``, ``object_bytes``).
    """

    #: The bucket that holds the chunk objects. Required; it must exist.
    bucket: str
    #: The server's URL (``http://`` or ``https://``). None (the default): AWS.
    endpoint_url: str | None = None
    #: The bucket's region (``us-east-1``).
    region: str = "us-east-1"
    #: Object names start with ``<prefix>/`` (``""``: at the top of the bucket).
    #: Leading and trailing ``/`` are dropped.
    prefix: str = ""
    #: The access key's id. None (with ``secret_access_key``): the standard AWS chain
    #: (environment, config files, instance role) provides the credentials.
    access_key_id: Secret[str] | None = None
    #: The access key's secret; required exactly when ``access_key_id`` is given.
    secret_access_key: Secret[str] | None = None
    #: A temporary credential's token; needs the key pair.
    session_token: Secret[str] | None = None
    #: ``path`` (bucket in the path), ``virtual`` (bucket in the host name) or
    #: ``auto``. Default: ``path`` with an ``endpoint_url`` (what S3-speaking servers
    #: other than AWS understand), else ``auto``.
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    #: A PEM file of the authorities that sign an ``https`` endpoint's certificate (a
    #: server signed by a private CA). None (the default): the system's authorities.
    ca_bundle: str | None = None
    #: Requests in flight at once (16), also the size of the connection pool.
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    #: Objects of this many bytes or more go up as multipart uploads (64 MiB).
    multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD
    #: The size of each part of a multipart upload (16 MiB; S3 allows 5 MiB to 5 GiB).
    multipart_part_bytes: int = DEFAULT_PART_BYTES
    #: Seconds to open a connection before the attempt fails (2).
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    #: Seconds of silence from the server, mid-response, before the attempt fails (10).
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    #: Times a request that failed transiently (throttling, 5xx, a broken connection)
    #: is sent again, with jittered exponential back-off (5).
    retry_attempts: int = DEFAULT_RETRY_ATTEMPTS
    #: Seconds a job's requests may take together, retries included, before the job
    #: fails. None (the default): two thirds of the tier's ``job_timeout_s`` (20 s of
    #: 30; :func:`kvtier.tiers.kit.job_deadline_s`). It must stay below
    #: ``job_timeout_s``. Filled in by :meth:`for_engine`.
    job_deadline_s: float | None = None
    #: Seconds a lookup's answer is reused before the server is asked again (2);
    #: 0 turns the cache off.
    lookup_cache_ttl_s: float = DEFAULT_LOOKUP_CACHE_TTL_S
    #: Send a HEAD before each upload of a chunk the tier knows nothing about (false:
    #: a conditional upload skips an object already there at no extra request).
    head_before_store: bool = False
    #: Sign each request's payload with SHA-256 (false: every chunk carries its own
    #: checksum, verified on every load).
    sign_payload: bool = False
    #: The size of every chunk object (header + primary row). Not a parameter: filled
    #: in from the engine's chunk size by :meth:`for_engine`.
    object_bytes: int | None = derived_field()

    @classmethod
    def from_params(cls, params: Mapping[str, Any], path: str) -> S3Settings:
        """Read the s3 tier's parameters; errors name ``path.<parameter>``, never a secret."""
        reader = ConfigReader(params, path)
        bucket = reader.string("bucket")
        if not _BUCKET.match(bucket):
            raise ConfigError(
                reader.path_of("bucket"),
                "expected a bucket name of 2-255 letters, digits, '.', '_' or '-'",
            )
        endpoint_url = reader.string("endpoint_url", None)
        if endpoint_url is not None:
            parts = urlsplit(endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(
                    reader.path_of("endpoint_url"), "expected an http:// or https:// URL"
                )
        region = reader.string("region", "us-east-1")
        prefix = reader.raw("prefix", "")
        if not isinstance(prefix, str):
            raise ConfigError(reader.path_of("prefix"), "expected a string")
        access_key_id = read_secret(reader, "access_key_id")
        secret_access_key = read_secret(reader, "secret_access_key")
        session_token = read_secret(reader, "session_token")
        if (access_key_id is None) != (secret_access_key is None):
            missing = "secret_access_key" if secret_access_key is None else "access_key_id"
            raise ConfigError(
                reader.path_of(missing), "is required when the other half of the key pair is set"
            )
        if session_token is not None and access_key_id is None:
            raise ConfigError(
                reader.path_of("session_token"), "needs access_key_id and secret_access_key"
            )
        settings = cls(
            bucket=bucket,
            endpoint_url=endpoint_url,
            region=region,
            prefix=prefix.strip("/"),
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            session_token=session_token,
            addressing_style=reader.string(
                "addressing_style",
                "path" if endpoint_url is not None else "auto",
                choices=_ADDRESSING_STYLES,
            ),
            ca_bundle=reader.string("ca_bundle", None),
            max_concurrency=reader.integer(
                "max_concurrency", DEFAULT_MAX_CONCURRENCY, minimum=1, maximum=_MAX_CONCURRENCY
            ),
            multipart_threshold=reader.integer(
                "multipart_threshold", DEFAULT_MULTIPART_THRESHOLD, minimum=1
            ),
            multipart_part_bytes=reader.integer(
                "multipart_part_bytes",
                DEFAULT_PART_BYTES,
                minimum=MIN_PART_BYTES,
                maximum=MAX_PART_BYTES,
            ),
            connect_timeout_s=reader.number(
                "connect_timeout_s", DEFAULT_CONNECT_TIMEOUT_S, minimum=0, exclusive_minimum=True
            ),
            read_timeout_s=reader.number(
                "read_timeout_s", DEFAULT_READ_TIMEOUT_S, minimum=0, exclusive_minimum=True
            ),
            retry_attempts=reader.integer(
                "retry_attempts", DEFAULT_RETRY_ATTEMPTS, minimum=0, maximum=_MAX_RETRY_ATTEMPTS
            ),
            job_deadline_s=reader.number("job_deadline_s", None, minimum=0, exclusive_minimum=True),
            lookup_cache_ttl_s=reader.number(
                "lookup_cache_ttl_s", DEFAULT_LOOKUP_CACHE_TTL_S, minimum=0
            ),
            head_before_store=reader.boolean("head_before_store", False),
            sign_payload=reader.boolean("sign_payload", False),
        )
        reader.reject_unknown()
        return settings

    def credentials(self) -> dict[str, str]:
        """The client's credential arguments: empty for the standard AWS chain."""
        given = {
            "aws_access_key_id": self.access_key_id,
            "aws_secret_access_key": self.secret_access_key,
            "aws_session_token": self.session_token,
        }
        return {name: secret.value for name, secret in given.items() if secret is not None}

    def for_engine(self, *, chunk_bytes: int, job_timeout_s: float, path: str) -> S3Settings:
        """These settings for an engine's chunks and job time-out: ``job_deadline_s``
        and ``object_bytes`` filled in.

        Raises:
            ConfigError: ``job_deadline_s`` is not below ``job_timeout_s``, or a chunk
                object would take more parts than S3 allows (named under ``path``).
        """
        return dataclasses.replace(
            self,
            job_deadline_s=self.job_deadline_for(job_timeout_s, path),
            object_bytes=self.object_bytes_for(chunk_bytes, path),
        )

    def job_deadline_for(self, job_timeout_s: float, path: str) -> float:
        """Seconds a job's requests may take, for a tier whose jobs time out after
        ``job_timeout_s``.

        Raises:
            ConfigError: ``job_deadline_s`` is not below ``job_timeout_s`` (named by
                ``path.job_deadline_s``).
        """
        return job_deadline_s(job_timeout_s, self.job_deadline_s, f"{path}.job_deadline_s")

    def object_bytes_for(self, chunk_bytes: int, path: str) -> int:
        """The size of the object that holds a chunk of ``chunk_bytes``.

        Raises:
            ConfigError: a multipart upload of it would take more parts than S3
                allows (named by ``path.multipart_part_bytes``).
        """
        object_bytes = HEADER_BYTES + chunk_bytes
        if object_bytes < self.multipart_threshold:
            return object_bytes
        parts = -(-object_bytes // self.multipart_part_bytes)
        if parts > MAX_PARTS:
            raise ConfigError(
                f"{path}.multipart_part_bytes",
                f"a chunk object of {object_bytes} bytes would take {parts} parts; "
                f"S3 allows {MAX_PARTS}",
            )
        return object_bytes


def display_url(url: str | None) -> str:
    """An endpoint as logs and messages may show it: no user info, path or query."""
    if url is None:
        return "AWS"
    parts = urlsplit(url)
    host = parts.hostname or "?"
    return f"{parts.scheme}://{host}:{parts.port}" if parts.port else f"{parts.scheme}://{host}"
