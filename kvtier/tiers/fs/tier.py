""":class:`FileSystemTier`: chunk files under a namespaced directory, indexed in memory.

See :mod:`kvtier.tiers.fs` for the layout, the data path and the index.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiofiles.os
import anyio
import anyio.to_thread

from kvtier.errors import ConfigError
from kvtier.format import (
    HEADER_BYTES,
    MAX_KEY_BYTES,
    MISSING,
    NAMESPACE_FILE,
    ChunkFormat,
    NamespaceDescription,
    chunk_name,
    chunk_path,
    namespace_directory,
    temp_name,
)
from kvtier.keys import OffloadKey
from kvtier.metrics import CounterDef, GaugeDef, MetricDefinition, tier_io_metric_definitions
from kvtier.records import Locality, Medium, OffloadingEvent
from kvtier.resources import TaskSet
from kvtier.tiers._depth import IoDepth, depth_gauge
from kvtier.tiers._fileio import advance, aligned_header, in_threads, size_of
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob
from kvtier.tiers.fs.files import (
    O_DIRECT,
    list_chunk_files,
    o_direct_works,
    read_chunk_file,
)
from kvtier.tiers.fs.settings import FsSettings
from kvtier.tiers.kit import CorruptChunks, EventLog, ThrottledLog, describe_error

__all__ = ["EVICTED_CHUNKS", "USED_BYTES", "FileSystemTier"]

logger = logging.getLogger(__name__)

USED_BYTES = "kvtier_fs_used_bytes"
EVICTED_CHUNKS = "kvtier_fs_evicted_chunks"


class FileSystemTier(SecondaryTier):
    """Chunks as files on a local or shared filesystem (parameters: :class:`FsSettings`)."""

    medium = Medium.STORAGE
    locality = Locality.LOCAL
    settings_class = FsSettings

    def __init__(self, ctx: TierContext, settings: FsSettings | None = None, **params: Any) -> None:
        super().__init__(ctx)
        if settings is None:
            # Built by hand, or by a subclass that reads its keyword arguments: the
            # parameters parsed and derived as the framework does.
            settings = FileSystemTier.settings_for(ctx, params)
        elif params:
            raise TypeError("pass FileSystemTier its settings or its parameters, not both")
        self.settings: FsSettings = settings
        self._format = ChunkFormat(ctx.namespace)
        self.directory = settings.root_dir / namespace_directory(ctx.model_name, self._format)
        self._root = str(self.directory)
        #: Whether files are written and read with O_DIRECT: decided at start.
        self.o_direct = False
        self._index: OrderedDict[OffloadKey, int] = OrderedDict()
        self._index_lock = threading.Lock()
        self._used_bytes = 0
        self._scanned = False
        self._file_bytes = HEADER_BYTES + ctx.chunk_bytes
        self._events = EventLog(ctx.enable_events)
        self._log = ThrottledLog(logger, f"tier {ctx.tier_name}")
        self._corrupt = CorruptChunks(ctx, self._log, self.path_of)
        # Their limiters and threads need a running event loop: start() creates them.
        metrics, name = ctx.metrics, ctx.tier_name
        self._reads = IoDepth(
            settings.read_range,
            depth_gauge(metrics, name, "read"),
            name=f"kvtier-{name}-read",
        )
        self._writes = IoDepth(
            settings.write_range,
            depth_gauge(metrics, name, "write"),
            name=f"kvtier-{name}-write",
        )
        self._tasks = TaskSet(f"tier {ctx.tier_name}")
        self._scan_done = asyncio.Event()

    @classmethod
    def effective_settings(
        cls, settings: Any, *, chunk_bytes: int, job_timeout_s: float, path: str
    ) -> FsSettings:
        """The settings with the depth an adaptive depth starts at for these chunks."""
        given: FsSettings = settings
        return given.for_chunks(chunk_bytes)

    @classmethod
    def build_metric_definitions(cls, settings: Any) -> dict[str, MetricDefinition]:
        return {
            USED_BYTES: GaugeDef("Bytes of chunk files the fs tier knows of, by tier.", ("tier",)),
            EVICTED_CHUNKS: CounterDef(
                "Chunk files the fs tier removed to stay within capacity_bytes, by tier.",
                ("tier",),
            ),
            **tier_io_metric_definitions(),
        }

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._reads.start()
        self._writes.start()
        await self._make_directory()
        await self._check_namespace_file()
        self.o_direct = await self._probe_o_direct()
        # The scan may take long on a big directory; lookups do not wait for it.
        self._tasks.spawn(self._scan(), name=f"scan {self.directory}")

    async def aclose(self) -> None:
        # The scan runs in a thread that cannot be interrupted: let it end.
        await self._tasks.wait()
        await self._tasks.aclose()
        self._reads.close()
        self._writes.close()

    async def _make_directory(self) -> None:
        """Create the namespace directory, and ``root_dir`` if missing; its parents never.

        A missing parent is most often a mistyped path or a volume that is not mounted:
        creating it would fill a disk nobody watches.
        """
        root = self.settings.root_dir
        path = f"{self.ctx.config_path}.root_dir"
        isdir, exists = aiofiles.os.path.isdir, aiofiles.os.path.exists
        if not await isdir(root):
            if await exists(root):
                raise ConfigError(path, f"{root} is not a directory")
            if await exists(root.parent) and not await isdir(root.parent):
                raise ConfigError(path, f"{root.parent} is not a directory")
            if not await exists(root.parent):
                raise ConfigError(
                    path,
                    f"{root.parent} does not exist: the fs tier creates root_dir, never its "
                    "parents (create them, or fix the path)",
                )
        try:
            await aiofiles.os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise ConfigError(path, f"cannot create {self.directory}: {exc.strerror}") from exc

    async def _check_namespace_file(self) -> None:
        path = self.directory / NAMESPACE_FILE
        try:
            existing = NamespaceDescription.from_json(await anyio.Path(path).read_text())
        except FileNotFoundError:
            own = NamespaceDescription(
                self.ctx.namespace, self.ctx.chunk_bytes, self.ctx.model_name
            )
            tmp = path.with_name(temp_name(path.name))
            await anyio.Path(tmp).write_text(own.to_json())
            await aiofiles.os.replace(tmp, path)
            return
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"{self.ctx.config_path}.root_dir", f"cannot read {path}: {exc}"
            ) from exc
        if existing is None or existing.namespace != self.ctx.namespace:
            raise ConfigError(
                f"{self.ctx.config_path}.root_dir",
                f"{path} describes another namespace than {self.ctx.namespace!r}",
            )

    async def _probe_o_direct(self) -> bool:
        if self.settings.o_direct is False:
            return False
        supported = await anyio.to_thread.run_sync(o_direct_works, self.directory)
        if self.settings.o_direct is True and not supported:
            raise ConfigError(
                f"{self.ctx.config_path}.o_direct",
                f"the filesystem of {self.directory} does not support O_DIRECT",
            )
        return supported

    async def _scan(self) -> None:
        try:
            found = await anyio.to_thread.run_sync(list_chunk_files, self.directory)
        except OSError as exc:
            self._log.warning("scan", "scanning %s failed: %s", self.directory, describe_error(exc))
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
        await self._evict_to_capacity()

    # ---------------------------------------------------------------- lookups

    def contains(self, key: OffloadKey) -> bool | None:
        with self._index_lock:
            if key in self._index:
                return True
        return False if self._scanned and not self.settings.shared else None

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        sizes = await anyio.to_thread.run_sync(self._stat_all, keys, limiter=self._reads.limiter)
        with self._index_lock:
            for key, size in zip(keys, sizes, strict=True):
                if size is not None and key not in self._index:
                    self._index[key] = size
                    self._used_bytes += size
        return [size is not None for size in sizes]

    def _stat_all(self, keys: Sequence[OffloadKey]) -> list[int | None]:
        return [size_of(self._file(key)) for key in keys]

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        with self._index_lock:
            index = self._index
            for key in reversed(keys):
                if key in index:
                    index.move_to_end(key)

    def path_of(self, key: OffloadKey) -> Path:
        """The file of ``key``'s chunk."""
        return self.directory / chunk_path(key)

    def _file_of(self, key: OffloadKey) -> tuple[str, str]:
        """:meth:`path_of` as the strings the I/O threads use: the chunk file's
        directory and name (a ``Path`` costs several microseconds a chunk to build)."""
        name = chunk_name(key)
        return f"{self._root}/{name[:2]}", name

    def _file(self, key: OffloadKey) -> str:
        """:meth:`path_of` as a string."""
        return "/".join(self._file_of(key))

    # ----------------------------------------------------------------- stores

    async def store(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        with self._index_lock:
            todo = [
                (key, view[chunk_id])
                for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True)
                if key not in self._index
            ]
        done = await in_threads(self._write_or_error, todo, self._writes, self._file_bytes)
        written = [key for key, error in done if error is None]
        errors = [error for _, error in done if error is not None]
        if written:
            with self._index_lock:
                for key in written:
                    if key not in self._index:
                        self._used_bytes += self._file_bytes
                    self._index[key] = self._file_bytes
                    self._index.move_to_end(key)
            self._events.add(written, self.medium, False, self.ctx.tier_name)
            await self._evict_to_capacity()
            self._publish_usage()
        if errors:
            raise OSError(
                errors[0].errno,
                f"{len(errors)} of {len(todo)} chunk writes failed, first: {errors[0]}",
            )
        return JobResult(job.job_id, True, transfer_bytes=len(written) * self.ctx.chunk_bytes)

    def _write_or_error(
        self, chunk: tuple[OffloadKey, memoryview]
    ) -> tuple[OffloadKey, OSError | None]:
        """Write one chunk file; its key and error or None. Runs in a thread."""
        key, row = chunk
        try:
            self._write_file(key, row)
        except OSError as exc:
            return key, exc
        return key, None

    def _write_file(self, key: OffloadKey, row: memoryview) -> None:
        """Write one chunk file; on any error no file of it is left. Runs in a thread."""
        if len(key) > MAX_KEY_BYTES:
            raise OSError(errno.ENAMETOOLONG, f"key of {len(key)} bytes is too long to store")
        directory, name = self._file_of(key)
        final = f"{directory}/{name}"
        tmp = f"{directory}/{temp_name(name)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        if self.o_direct:
            flags |= O_DIRECT
        header = memoryview(aligned_header() if self.o_direct else bytearray(HEADER_BYTES))
        self._format.pack_header(header, key, row)
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(tmp, flags, 0o644)
        total = HEADER_BYTES + len(row)
        try:
            self._write_all(fd, [header, row], total)
            if self.settings.fsync:
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
            buffers = advance(buffers, written)

    #: The write syscall, a seam for tests that must fail it where no small filesystem
    #: can be mounted.
    _pwritev = staticmethod(os.pwritev)

    async def _evict_to_capacity(self) -> None:
        capacity = self.settings.capacity_bytes
        if capacity is None:
            return
        victims: list[tuple[OffloadKey, int]] = []
        with self._index_lock:
            while self._used_bytes > capacity and self._index:
                key, size = self._index.popitem(last=False)
                self._used_bytes -= size
                victims.append((key, size))
        if not victims:
            return
        await anyio.to_thread.run_sync(self._unlink_all, [key for key, _ in victims])
        self._events.add([key for key, _ in victims], self.medium, True, self.ctx.tier_name)
        self.ctx.metrics.inc(EVICTED_CHUNKS, len(victims), (self.ctx.tier_name,))

    def _unlink_all(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Remove the files of ``keys``; the keys whose file is gone. Runs in a thread."""
        gone = []
        for key in keys:
            try:
                os.unlink(self._file(key))
            except FileNotFoundError:
                pass
            except OSError:
                continue
            gone.append(key)
        return gone

    async def _remove(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        return await anyio.to_thread.run_sync(self._unlink_all, keys)

    async def clear(self) -> bool:
        """Remove every chunk file of the namespace directory, indexed or not (engines
        sharing the directory lose them too)."""
        await self._scan_done.wait()  # a scan still running would index them again
        try:
            listed = await anyio.to_thread.run_sync(list_chunk_files, self.directory)
        except OSError as exc:
            self._log.warning("clear", "listing %s failed: %s", self.directory, describe_error(exc))
            return False
        with self._index_lock:
            keys = set(self._index)
        keys.update(key for key, _, _ in listed)
        gone = await self._remove(list(keys))
        self._forget(gone)
        return len(gone) == len(keys)

    # ------------------------------------------------------------------ loads

    async def load(self, job: TransferJob) -> JobResult:
        view = self.ctx.primary_view
        chunks = [
            (key, view[chunk_id]) for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True)
        ]
        outcomes = dict(await in_threads(self._read_chunk, chunks, self._reads, self._file_bytes))
        loaded = [key for key in job.keys if outcomes.get(key) is None]
        lost = [key for key in job.keys if outcomes.get(key) is not None]
        if lost:
            corrupt = {k: r for k, r in outcomes.items() if r is not None and r != MISSING}
            await self._corrupt.discard(corrupt, f"promotion job {job.job_id}", self._remove)
            self._forget(lost)
        return JobResult(job.job_id, not lost, successful_keys=loaded)

    def _read_chunk(self, chunk: tuple[OffloadKey, memoryview]) -> tuple[OffloadKey, str | None]:
        """Read one chunk; its key and what :func:`read_chunk_file` found. Runs in a
        thread."""
        key, row = chunk
        return key, read_chunk_file(self._file(key), key, row, self._format, self.o_direct)

    def _forget(self, keys: Sequence[OffloadKey]) -> None:
        if not keys:
            return
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
    def read_depth(self) -> int:
        """Chunk files read at once now (the fixed depth, or where it adapted to)."""
        return self._reads.depth

    @property
    def write_depth(self) -> int:
        """Chunk files written at once now; see :attr:`read_depth`."""
        return self._writes.depth

    @property
    def indexed_keys(self) -> int:
        return len(self._index)

    async def wait_scanned(self) -> None:
        """Wait for the start-up scan (tests and tools)."""
        await self._scan_done.wait()

    def _publish_usage(self) -> None:
        self.ctx.metrics.set(USED_BYTES, self._used_bytes, (self.ctx.tier_name,))
