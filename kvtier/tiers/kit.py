"""The tier kit: what every real tier needs besides its own I/O.

A tier that talks to a server or a disk meets the same few problems as every other:
parsing its settings with errors that name the key, keeping credentials out of logs,
ending its own I/O before the framework gives up on a job, logging a failure that
repeats once rather than per chunk, and dealing with a stored chunk that fails
verification. The built-in tiers use this module for all of them, and so can a plugin;
nothing here is private to kvtier.

=========================  ===========================================================
settings                   :class:`ConfigReader` (typed reads, errors naming
                           ``secondary_tiers[i].key``, unknown keys refused),
                           :class:`~kvtier.errors.ConfigError`,
                           :func:`parse_address` for a ``host:port``, and
                           :func:`derived_field` for a value the tier derives from
                           the engine (filled in by ``effective_settings``)
credentials                :class:`Secret` (never shown), :func:`read_secret`,
                           :func:`read_secret_file` (a file only its owner may read),
                           :func:`redact`
a deadline under the job   :func:`job_deadline_s`: how long one job's I/O may take,
timeout                    retries included, so the tier fails it itself, with a
                           reason, before the framework's ``job_timeout_s``
logs                       :class:`ThrottledLog` (a recurring failure once, then a
                           count), :func:`describe_error`
corrupt chunks             :class:`CorruptChunks`: count, remove, log once; never serve
events                     :class:`EventLog`: store and removal events for
                           ``take_events``
a client that blocks       :class:`IoDepth` (one direction's threads, their depth
                           :class:`DepthRange`, published by :func:`depth_gauge`) and
                           :func:`in_threads`, which runs a job's blocking calls there:
                           when it returns or is cancelled, every call has ended, so a
                           thread never touches a slot its job no longer owns
registering memory         ``ctx.primary_view.memory_range()``: the primary region's
                           address and length, for a client that registers the
                           memory it moves bytes in and out of (RDMA, a transfer engine)
=========================  ===========================================================

The chunk format itself (a header with the key, the namespace and two checksums, then
the primary row) is :mod:`kvtier.format`: ``ChunkFormat(ctx.namespace)`` packs a
header with ``pack_header`` before a store and checks one with ``verify`` after a load.
:mod:`kvtier.tiers.memcached` is a complete remote tier built from these parts;
:mod:`kvtier.tiers.mooncake` one whose client blocks and registers the region.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from kvtier._logs import ThrottledLog, describe_error
from kvtier._secrets import SECRET_KEYS, Secret, redact
from kvtier.config import ConfigReader
from kvtier.errors import ConfigError
from kvtier.keys import OffloadKey
from kvtier.records import EventLog
from kvtier.tiers._depth import DepthRange, IoDepth, depth_gauge
from kvtier.tiers._fileio import in_threads
from kvtier.tiers.base import TierContext

__all__ = [
    "JOB_DEADLINE_SHARE",
    "SECRET_KEYS",
    "ConfigError",
    "ConfigReader",
    "CorruptChunks",
    "DepthRange",
    "EventLog",
    "IoDepth",
    "Secret",
    "ThrottledLog",
    "depth_gauge",
    "derived_field",
    "describe_error",
    "in_threads",
    "is_derived",
    "job_deadline_s",
    "parse_address",
    "read_secret",
    "read_secret_file",
    "redact",
]

#: The share of the framework's ``job_timeout_s`` a job's own I/O gets by default (20 s
#: of the default 30 s): the tier ends its requests, closes their connections and
#: reports why, while the framework's time-out, which can only cancel, stays a last
#: resort. The third left over covers a retry's back-off that began just before the
#: deadline and the slow end of closing a connection.
JOB_DEADLINE_SHARE = 2 / 3


def derived_field(default: Any = None) -> Any:
    """A field of a settings record that is no parameter: the tier derives it from the
    engine (the chunk size, the job time-out) in its ``effective_settings``, once.

    ``from_params`` leaves it at ``default``; ``kvtier plan`` shows it filled in.
    """
    return dataclasses.field(default=default, metadata={_DERIVED: True})


def is_derived(field: dataclasses.Field[Any]) -> bool:
    """Whether a settings record's ``field`` was declared with :func:`derived_field`."""
    return bool(field.metadata.get(_DERIVED))


_DERIVED = "kvtier_derived"


def parse_address(value: str, path: str, *, listen: bool = False) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"``) as ``(host, port)``; port 0 only to listen.

    Raises:
        ConfigError: (named by ``path``) not of that form, or a port out of range.
    """
    host, colon, port_text = value.rpartition(":")
    if not colon or not host or not port_text.isdigit():
        raise ConfigError(path, f'expected "host:port", got {value!r}')
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(path, f"write an IPv6 address in brackets, [{host}]:{port_text}")
    port = int(port_text)
    lowest = 0 if listen else 1
    if not lowest <= port <= 65535:
        raise ConfigError(path, f"expected a port in [{lowest}, 65535], got {port}")
    return host, port


def job_deadline_s(job_timeout_s: float, given: float | None, path: str) -> float:
    """Seconds one job's I/O may take, retries included, for a tier whose jobs the
    framework times out after ``job_timeout_s``.

    ``given`` is the tier's own setting (None: :data:`JOB_DEADLINE_SHARE` of
    ``job_timeout_s``). A tier computes this once, in its ``effective_settings``, so
    that ``kvtier plan`` shows it, and starts each job with ``anyio.fail_after`` (or a
    deadline on the monotonic clock) of that many seconds.

    Raises:
        ConfigError: ``given`` is not below ``job_timeout_s`` (named by ``path``, the
            setting's full key path).
    """
    if given is None:
        return job_timeout_s * JOB_DEADLINE_SHARE
    if given >= job_timeout_s:
        raise ConfigError(
            path,
            f"must be below the tier's job_timeout_s ({job_timeout_s:g} s), or the "
            "framework gives up on jobs while their requests still run",
        )
    return given


def read_secret(reader: ConfigReader, key: str) -> Secret[str] | None:
    """The credential ``key`` (a string) wrapped as a :class:`Secret`; None if unset.

    A bad value's error names the key, never the value.
    """
    value: str | None = reader.string(key, None, secret=True)
    return None if value is None else Secret(value)


def read_secret_file(path: str, config_path: str, *, min_bytes: int = 1) -> Secret[bytes]:
    """Read a credential from a file that only its owner may access; a trailing newline
    is dropped. Blocks: call it from a thread (``anyio.to_thread.run_sync``) in
    ``start``, never from the settings' parsing (which opens nothing).

    Raises:
        ConfigError: (named by ``config_path``) the file cannot be opened, is not a
            regular file, is accessible to its group or others, or holds fewer than
            ``min_bytes`` bytes.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(config_path, f"cannot open {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(config_path, f"{path} is not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise ConfigError(
                config_path,
                f"{path} has mode {mode:04o}: a secret file must not be readable (or "
                f"writable) by its group or the world; run chmod 600 {path}",
            )
        with os.fdopen(os.dup(fd), "rb") as file:
            # A credential is short: a file far longer is not one.
            data = file.read(1 << 16)
    finally:
        os.close(fd)
    value = data.rstrip(b"\r\n")
    if len(value) < min_bytes:
        raise ConfigError(config_path, f"{path} holds fewer than {min_bytes} bytes of secret")
    return Secret(value)


class CorruptChunks:
    """A tier's handling of stored chunks that failed verification.

    Such a chunk is never served: the tier counts it as an integrity failure
    (``kvtier_tiering_integrity_failures``), removes it so that it is stored again
    whole, and says so in one log line per operation. ``where`` gives a chunk's
    location (a path, a URL, a server key) for that line.
    """

    def __init__(
        self, ctx: TierContext, log: ThrottledLog, where: Callable[[OffloadKey], object]
    ) -> None:
        self._ctx = ctx
        self._log = log
        self._where = where

    async def discard(
        self,
        problems: Mapping[OffloadKey, str],
        during: str,
        remove: Callable[[Sequence[OffloadKey]], Awaitable[Sequence[OffloadKey]]],
    ) -> Sequence[OffloadKey]:
        """Count, remove and report chunks found corrupt ``during`` one operation.

        ``problems`` maps each key to what was wrong with its chunk (what
        ``ChunkFormat.verify`` answered). ``remove`` deletes chunks by key and returns
        the keys it removed; it must not raise (a chunk it could not remove fails
        verification again next time). Returns the keys whose chunks were removed.
        """
        if not problems:
            return []
        self._ctx.report_integrity_failure(len(problems))
        removed = await remove(list(problems))
        self._log.warning(
            "corrupt",
            "%d stored chunk(s) failed verification during %s (%s), e.g. %s; "
            "%d removed, never served",
            len(problems),
            during,
            ", ".join(sorted(set(problems.values()))),
            self._where(next(iter(problems))),
            len(removed),
        )
        return removed
