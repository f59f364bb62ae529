"""The filesystem tier: one verified file per chunk under a namespaced directory.

Layout::

    <root_dir>/<model>_<namespace digest>/namespace.json
    <root_dir>/<model>_<namespace digest>/<hh>/<key hex>.kvt

Each file is a one-page header (magic, version, key, length, checksums) followed by
the chunk's primary row (see :mod:`kvtier.tiers._format`). A file is written under a
unique temporary name and renamed into place, so a reader never sees a torn file; a
crash leaves at most a temporary file, which the next start removes. Every load is
verified before the chunk is reported loaded: a corrupt, truncated or foreign file is a
failed load, removed and counted, never served.

Data path: ``os.pwritev`` / ``os.preadv`` straight between the file and the region's
memoryview (one copy, no ``bytes`` per chunk), on a small dedicated thread limiter per
direction. aiofiles would add two thread hops and a new ``bytes`` per read; it measured
lag spikes of up to 40 ms here, so it serves only the metadata side (directories,
``namespace.json``).

An in-memory index (key -> size, least recently used first) answers lookups at once
and drives ``capacity_bytes`` eviction. It is rebuilt at start by a background scan
ordered by modification time, which loads refresh, so recency survives restarts. With
``shared`` (the default) a key the index does not know is looked for on disk too, so
another process or node writing to the same ``root_dir`` is seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import mmap
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiofiles.os
import anyio
import anyio.to_thread

from kvtier.errors import ConfigError
from kvtier.keys import OffloadKey
from kvtier.metrics import CounterDef, GaugeDef, MetricDefinition
from kvtier.records import EventLog, Medium, OffloadingEvent
from kvtier.tiers._format import HEADER_BYTES, MAX_KEY_BYTES, ChunkFormat
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob

__all__ = ["FileSystemTier"]

logger = logging.getLogger(__name__)

SUFFIX = ".kvt"
USED_BYTES = "kvtier_fs_used_bytes"
EVICTED_CHUNKS = "kvtier_fs_evicted_chunks"

# Queue depths (concurrent chunk I/Os) measured with benchmarks/fs_tier.py on the
# project's VM disk, 2 MiB chunks: cold reads of O_DIRECT-written files went from 0.80
# of raw preadv at depth 2 to 0.90-0.95 at depth 4; O_DIRECT writes reach 0.93-0.98 of
# raw pwritev at depth 4. Other disks differ: both are settings.
DEFAULT_READ_DEPTH = 4
DEFAULT_WRITE_DEPTH = 4
# Temporary files older than this belong to writers that died; younger ones may be live.
STALE_TMP_S = 3600.0
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_MODEL_SLUG = re.compile(r"[^A-Za-z0-9._-]+")
_MISSING = "missing"
_Item = TypeVar("_Item")


class FileSystemTier(SecondaryTier):
    """Chunks as files on a local or shared filesystem.

    Parameters: ``root_dir`` (required); ``capacity_bytes`` (evict least recently
    used files beyond it); ``read_depth`` / ``write_depth`` (concurrent reads / writes,
    4 / 4), or ``io_concurrency`` to set both; ``o_direct`` (``"auto"``, true, false:
    write without the page cache; auto uses it where the filesystem supports it);
    ``fsync`` (flush each file before it becomes visible, false); ``shared`` (other
    writers may add files: look on disk for keys the index does not know, true).
    """

    medium = Medium.STORAGE
    locality = "local"

    def __init__(self, ctx: TierContext, **params: Any) -> None:
        super().__init__(ctx)
        settings = ctx.read(params)
        self.root_dir = Path(settings.string("root_dir")).expanduser()
        self.capacity_bytes: int | None = settings.integer("capacity_bytes", None, minimum=1)
        depth = settings.integer("io_concurrency", None, minimum=1, maximum=256)
        self.read_depth: int = settings.integer(
            "read_depth", depth or DEFAULT_READ_DEPTH, minimum=1, maximum=256
        )
        self.write_depth: int = settings.integer(
            "write_depth", depth or DEFAULT_WRITE_DEPTH, minimum=1, maximum=256
        )
        o_direct = settings.raw("o_direct", "auto")
        if o_direct not in ("auto", True, False):
            raise ConfigError(settings.path_of("o_direct"), 'expected "auto", true or false')
        self.o_direct_setting: str | bool = o_direct
        self.fsync: bool = settings.boolean("fsync", False)
        self.shared: bool = settings.boolean("shared", True)
        settings.reject_unknown()
        self._format = ChunkFormat(ctx.namespace)
        slug = _MODEL_SLUG.sub("_", ctx.model_name).strip("_")[:64] or "model"
        self.directory = self.root_dir / f"{slug}_{self._format.digest_hex}"
        self.o_direct = False
        self._index: OrderedDict[OffloadKey, int] = OrderedDict()
        self._index_lock = threading.Lock()
        self._used_bytes = 0
        self._scanned = False
        self._file_bytes = HEADER_BYTES + ctx.chunk_bytes
        self._events = EventLog(ctx.enable_events)
        # Both need a running event loop, so start() creates them.
        self._readers: anyio.CapacityLimiter | None = None
        self._writers: anyio.CapacityLimiter | None = None
        self._scan_task: asyncio.Task[None] | None = None
        self._scan_done = asyncio.Event()

    @classmethod
    def build_metric_definitions(
        cls, tier_config: Mapping[str, Any]
    ) -> dict[str, MetricDefinition]:
        return {
            USED_BYTES: GaugeDef("Bytes of chunk files the fs tier knows of, by tier.", ("tier",)),
            EVICTED_CHUNKS: CounterDef(
                "Chunk files the fs tier removed to stay within capacity_bytes, by tier.",
                ("tier",),
            ),
        }

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._readers = anyio.CapacityLimiter(self.read_depth)
        self._writers = anyio.CapacityLimiter(self.write_depth)
        await aiofiles.os.makedirs(self.directory, exist_ok=True)
        await self._check_namespace_file()
        self.o_direct = await self._probe_o_direct()
        # The scan may take long on a big directory; lookups do not wait for it.
        self._scan_task = asyncio.create_task(self._scan())

    async def aclose(self) -> None:
        if self._scan_task is not None:
            task, self._scan_task = self._scan_task, None
            await task

    async def _check_namespace_file(self) -> None:
        path = self.directory / "namespace.json"
        description = {
            "kvtier_chunk_format": 1,
            "namespace": self.ctx.namespace,
            "chunk_bytes": self.ctx.chunk_bytes,
            "model": self.ctx.model_name,
        }
        try:
            existing = json.loads(await anyio.Path(path).read_text())
        except FileNotFoundError:
            tmp = path.with_name(f"namespace.json.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            await anyio.Path(tmp).write_text(json.dumps(description, indent=2) + "\n")
            await aiofiles.os.replace(tmp, path)
            return
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"{self.ctx.config_path}.root_dir", f"cannot read {path}: {exc}"
            ) from exc
        if not isinstance(existing, dict) or existing.get("namespace") != self.ctx.namespace:
            raise ConfigError(
                f"{self.ctx.config_path}.root_dir",
                f"{path} describes another namespace than {self.ctx.namespace!r}",
            )

    async def _probe_o_direct(self) -> bool:
        if self.o_direct_setting is False:
            return False
        supported = await anyio.to_thread.run_sync(self._o_direct_works)
        if self.o_direct_setting is True and not supported:
            raise ConfigError(
                f"{self.ctx.config_path}.o_direct",
                f"the filesystem of {self.directory} does not support O_DIRECT",
            )
        return supported

    def _o_direct_works(self) -> bool:
        if not _O_DIRECT:
            return False
        probe = self.directory / f".o_direct_probe.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o600)
        except OSError:
            return False
        try:
            page = mmap.mmap(-1, HEADER_BYTES)
            try:
                os.pwrite(fd, page, 0)
            finally:
                page.close()
        except OSError:
            return False
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(probe)
        return True

    async def _scan(self) -> None:
        try:
            found = await anyio.to_thread.run_sync(self._list_files)
        except OSError as exc:
            logger.warning(
                "tier %s: scanning %s failed: %s", self.ctx.tier_name, self.directory, exc
            )
            found = []
        # Oldest first; keys stored while the scan ran are newer and stay where they are.
        with self._index_lock:
            for key, size, _ in sorted(found, key=lambda item: item[2], reverse=True):
                if key not in self._index:
                    self._index[key] = size
                    self._index.move_to_end(key, last=False)
                    self._used_bytes += size
            self._scanned = True
        self._scan_done.set()
        self._publish_usage()
        if self.capacity_bytes is not None:
            await self._evict_to_capacity()

    def _list_files(self) -> list[tuple[OffloadKey, int, float]]:
        found: list[tuple[OffloadKey, int, float]] = []
        now = time.time()
        with os.scandir(self.directory) as top:
            subdirs = [entry.path for entry in top if entry.is_dir(follow_symlinks=False)]
        for subdir in subdirs:
            with os.scandir(subdir) as entries:
                for entry in entries:
                    name = entry.name
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if name.endswith(".tmp"):
                        if now - st.st_mtime > STALE_TMP_S:
                            with contextlib.suppress(OSError):
                                os.unlink(entry.path)
                        continue
                    if name.endswith(SUFFIX):
                        key = _key_of(name)
                        if key is not None:
                            found.append((key, st.st_size, st.st_mtime))
        return found

    # ---------------------------------------------------------------- lookups

    def contains(self, key: OffloadKey) -> bool | None:
        with self._index_lock:
            if key in self._index:
                return True
        return False if self._scanned and not self.shared else None

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        sizes = await anyio.to_thread.run_sync(self._stat_all, keys, limiter=self._readers)
        with self._index_lock:
            for key, size in zip(keys, sizes, strict=True):
                if size is not None and key not in self._index:
                    self._index[key] = size
                    self._used_bytes += size
        return [size is not None for size in sizes]

    def _stat_all(self, keys: Sequence[OffloadKey]) -> list[int | None]:
        return [_size_of(self.path_of(key)) for key in keys]

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        with self._index_lock:
            index = self._index
            for key in reversed(keys):
                if key in index:
                    index.move_to_end(key)

    def path_of(self, key: OffloadKey) -> Path:
        name = key.hex()
        return self.directory / name[:2] / f"{name}{SUFFIX}"

    # ----------------------------------------------------------------- stores

    async def store(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        with self._index_lock:
            todo = [
                (key, chunk_id)
                for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True)
                if key not in self._index
            ]
        errors: list[BaseException] = []
        written: list[OffloadKey] = []

        async def write_stripe(stripe: list[tuple[OffloadKey, int]]) -> None:
            done = await anyio.to_thread.run_sync(
                self._write_stripe,
                [(key, view[chunk_id]) for key, chunk_id in stripe],
                limiter=self._writers,
            )
            for key, error in done:
                if error is None:
                    written.append(key)
                else:
                    errors.append(error)

        async with anyio.create_task_group() as group:
            for stripe in _stripes(todo, self.write_depth):
                group.start_soon(write_stripe, stripe)
        if written:
            with self._index_lock:
                for key in written:
                    if key not in self._index:
                        self._used_bytes += self._file_bytes
                    self._index[key] = self._file_bytes
                    self._index.move_to_end(key)
            self._events.add(written, self.medium, False, self.ctx.tier_name)
            if self.capacity_bytes is not None:
                await self._evict_to_capacity()
            self._publish_usage()
        if errors:
            raise OSError(
                errors[0].errno if isinstance(errors[0], OSError) else errno.EIO,
                f"{len(errors)} of {len(todo)} chunk writes failed, first: {errors[0]}",
            )
        return JobResult(job.job_id, True, transfer_bytes=len(written) * self.ctx.chunk_bytes)

    def _write_stripe(
        self, chunks: list[tuple[OffloadKey, memoryview]]
    ) -> list[tuple[OffloadKey, OSError | None]]:
        """Write chunks one after another on one I/O thread; each one's error or None."""
        return [(key, self._write_or_error(key, row)) for key, row in chunks]

    def _write_or_error(self, key: OffloadKey, row: memoryview) -> OSError | None:
        try:
            self._write_file(key, row)
        except OSError as exc:
            return exc
        return None

    def _write_file(self, key: OffloadKey, row: memoryview) -> None:
        """Write one chunk file; on any error no file of it is left. Runs in a thread."""
        if len(key) > MAX_KEY_BYTES:
            raise OSError(errno.ENAMETOOLONG, f"key of {len(key)} bytes is too long to store")
        final = self.path_of(key)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        if self.o_direct:
            flags |= _O_DIRECT
        header = memoryview(_aligned_header() if self.o_direct else bytearray(HEADER_BYTES))
        self._format.pack_header(header, key, row)
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:
            os.makedirs(final.parent, exist_ok=True)
            fd = os.open(tmp, flags, 0o644)
        total = HEADER_BYTES + len(row)
        try:
            self._write_all(fd, [header, row], total)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        try:
            os.rename(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _write_all(self, fd: int, buffers: list[memoryview], total: int) -> None:
        offset = 0
        while offset < total:
            written = self._pwritev(fd, buffers, offset)
            if written <= 0:
                raise OSError(errno.EIO, "the filesystem accepted no bytes")
            offset += written
            buffers = _advance(buffers, written)

    #: The write syscall, a seam for tests that must fail it where no small filesystem
    #: can be mounted.
    _pwritev = staticmethod(os.pwritev)

    async def _evict_to_capacity(self) -> None:
        assert self.capacity_bytes is not None
        victims: list[tuple[OffloadKey, int]] = []
        with self._index_lock:
            while self._used_bytes > self.capacity_bytes and self._index:
                key, size = self._index.popitem(last=False)
                self._used_bytes -= size
                victims.append((key, size))
        if not victims:
            return
        await anyio.to_thread.run_sync(self._unlink_all, [key for key, _ in victims])
        self._events.add([key for key, _ in victims], self.medium, True, self.ctx.tier_name)
        self.ctx.metrics.inc(EVICTED_CHUNKS, len(victims), (self.ctx.tier_name,))

    def _unlink_all(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path_of(key))

    # ------------------------------------------------------------------ loads

    async def load(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        outcomes: dict[OffloadKey, str | None] = {}

        async def read_stripe(stripe: list[tuple[OffloadKey, int]]) -> None:
            done = await anyio.to_thread.run_sync(
                self._read_stripe,
                [(key, view[chunk_id]) for key, chunk_id in stripe],
                limiter=self._readers,
            )
            outcomes.update(done)

        chunks = list(zip(job.keys, job.chunk_ids, strict=True))
        async with anyio.create_task_group() as group:
            for stripe in _stripes(chunks, self.read_depth):
                group.start_soon(read_stripe, stripe)
        loaded = [key for key in job.keys if outcomes.get(key) is None]
        lost = [key for key in job.keys if outcomes.get(key) is not None]
        if lost:
            self._forget(lost)
            corrupt = {k: r for k, r in outcomes.items() if r is not None and r != _MISSING}
            if corrupt:
                self.ctx.report_integrity_failure(len(corrupt))
                reasons = sorted(set(corrupt.values()))
                logger.warning(
                    "tier %s: %d chunk file(s) of job %d failed verification (%s); removed",
                    self.ctx.tier_name,
                    len(corrupt),
                    job.job_id,
                    ", ".join(reasons),
                )
        return JobResult(job.job_id, not lost, successful_keys=loaded)

    def _read_stripe(
        self, chunks: list[tuple[OffloadKey, memoryview]]
    ) -> list[tuple[OffloadKey, str | None]]:
        """Read chunks one after another on one I/O thread; see :meth:`_read_file`."""
        return [(key, self._read_file(key, row)) for key, row in chunks]

    def _read_file(self, key: OffloadKey, row: memoryview) -> str | None:
        """Read and verify one chunk into ``row``: None, "missing", or what was wrong.

        Runs in a thread. A file that fails verification is removed.
        """
        path = self.path_of(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return _MISSING
        header = bytearray(HEADER_BYTES)
        expected = HEADER_BYTES + len(row)
        try:
            size = os.fstat(fd).st_size
            got = _read_all(fd, [memoryview(header), row], expected)
        finally:
            os.close(fd)
        if got < expected or size != expected:
            problem: str | None = "truncated file" if got < expected else "trailing bytes"
        else:
            problem = self._format.verify(header, key, row)
        if problem is None:
            # Loads refresh the modification time: it orders eviction after a restart.
            with contextlib.suppress(OSError):
                os.utime(path)
            return None
        with contextlib.suppress(OSError):
            os.unlink(path)
        return problem

    def _forget(self, keys: Sequence[OffloadKey]) -> None:
        removed: list[OffloadKey] = []
        with self._index_lock:
            for key in keys:
                size = self._index.pop(key, None)
                if size is not None:
                    self._used_bytes -= size
                    removed.append(key)
        self._events.add(removed, self.medium, True, self.ctx.tier_name)
        self._publish_usage()

    # ------------------------------------------------------------------ misc

    def take_events(self) -> list[OffloadingEvent]:
        return self._events.take()

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def indexed_keys(self) -> int:
        return len(self._index)

    async def wait_scanned(self) -> None:
        """Wait for the start-up scan (tests and tools)."""
        await self._scan_done.wait()

    def _publish_usage(self) -> None:
        self.ctx.metrics.set(USED_BYTES, self._used_bytes, (self.ctx.tier_name,))


def _stripes(items: list[_Item], count: int) -> list[list[_Item]]:
    """``items`` cut into at most ``count`` contiguous runs of near-equal length.

    Each run is one thread call: a thread that moves several chunks back to back keeps
    the disk busy without a trip through the event loop between chunks.
    """
    count = max(1, min(count, len(items)))
    size, extra = divmod(len(items), count)
    stripes: list[list[_Item]] = []
    start = 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        stripes.append(items[start:end])
        start = end
    return stripes


def _size_of(path: Path) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _key_of(name: str) -> OffloadKey | None:
    try:
        return OffloadKey(bytes.fromhex(name[: -len(SUFFIX)]))
    except ValueError:
        return None


_thread_buffers = threading.local()


def _aligned_header() -> mmap.mmap:
    """A page-aligned header buffer for O_DIRECT writes, one per I/O thread."""
    buffer: mmap.mmap | None = getattr(_thread_buffers, "header", None)
    if buffer is None:
        buffer = mmap.mmap(-1, HEADER_BYTES)
        _thread_buffers.header = buffer
    return buffer


def _read_all(fd: int, buffers: list[memoryview], total: int) -> int:
    offset = 0
    while offset < total:
        got = os.preadv(fd, buffers, offset)
        if got <= 0:
            break
        offset += got
        buffers = _advance(buffers, got)
    return offset


def _advance(buffers: list[memoryview], count: int) -> list[memoryview]:
    """The part of ``buffers`` after the first ``count`` bytes."""
    rest: list[memoryview] = []
    for buffer in buffers:
        if count >= len(buffer):
            count -= len(buffer)
            continue
        rest.append(buffer[count:] if count else buffer)
        count = 0
    return rest
