"""The filesystem tier: one verified file per chunk under a namespaced directory.

Layout::

    <root_dir>/<model>_<namespace digest>/namespace.json
    <root_dir>/<model>_<namespace digest>/<hh>/<key hex>.kvt

Each file is a one-page header (magic, version, key, length, checksums) followed by
the chunk's primary row (see :mod:`kvtier.format`). A file is written under a
unique temporary name and renamed into place, so a reader never sees a torn file; a
crash leaves at most a temporary file, which the next start removes. Every load is
verified before the chunk is reported loaded: a corrupt, truncated or foreign file is a
failed load, removed and counted, never served.

Data path: ``os.pwritev`` / ``os.preadv`` straight between the file and the region's
memoryview (one copy, no ``bytes`` per chunk), on a few threads of the tier's own per
direction (:mod:`kvtier.tiers._threads`), as many at once as the queue depth, which
follows what the disk delivers unless a fixed depth is set (:mod:`kvtier.tiers._depth`).
aiofiles would add two thread hops and a new ``bytes`` per read; it measured lag spikes
of up to 40 ms here, so it serves only the metadata side (directories,
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
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiofiles.os
import anyio
import anyio.to_thread

from kvtier._logs import ThrottledLog, describe_error
from kvtier.config import ConfigReader
from kvtier.errors import ConfigError
from kvtier.format import (
    HEADER_BYTES,
    MAX_KEY_BYTES,
    MISSING,
    NAMESPACE_FILE,
    TEMP_SUFFIX,
    ChunkFormat,
    NamespaceDescription,
    chunk_name,
    chunk_path,
    key_of,
    namespace_directory,
    temp_name,
)
from kvtier.keys import OffloadKey
from kvtier.metrics import CounterDef, GaugeDef, MetricDefinition, tier_io_metric_definitions
from kvtier.records import EventLog, Medium, OffloadingEvent
from kvtier.resources import TaskSet
from kvtier.tiers._corrupt import CorruptChunks
from kvtier.tiers._depth import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MIN_DEPTH,
    DEFAULT_START_DEPTH,
    DepthRange,
    IoDepth,
    depth_gauge,
)
from kvtier.tiers._fileio import advance, aligned_header, in_threads, read_all, size_of
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob

__all__ = ["FileSystemTier", "FsSettings"]

logger = logging.getLogger(__name__)

USED_BYTES = "kvtier_fs_used_bytes"
EVICTED_CHUNKS = "kvtier_fs_evicted_chunks"

# Far beyond any useful depth (the measured optima were 4 to 16): a typo, not a tuning.
_MAX_DEPTH = 256
AUTO: Literal["auto"] = "auto"
# Temporary files older than this belong to writers that died; younger ones may be live.
STALE_TMP_S = 3600.0
# A load refreshes its file's modification time (what orders eviction after a restart)
# only when it is older than this: the refresh is a metadata write, journaled, on every
# promotion otherwise, and an order to the minute is all a restart needs.
MTIME_REFRESH_S = 60.0
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# Where an adaptive depth starts, both ways. Measured with benchmarks/vs_vllm.py (4 GiB
# of 2 MiB chunks) with no file removed in the minutes before (removals had made every
# file creation CPU-bound, which favoured low depths): stores from depth 4 ran at
# 1.34-1.35 GB/s (the depth had climbed to 7 when the 2-3 s burst ended), at 1.65 from
# 16 and 1.59-2.31 from 32, at less CPU per GiB (0.55-0.60 s against 0.68-0.70);
# promotions at 1.55-1.61 GB/s from 4 and 1.74-1.92 at 16, the median request waiting
# 230-252 ms against 319-327. A burst is often over before a climb from 4 gets far, and
# a depth that does not pay is stepped down.
START_DEPTH = 16
# Chunks smaller than this start at DEFAULT_START_DEPTH (4) instead: creating and
# opening their files costs more CPU than moving their bytes, and more threads on few
# cores only contend for it. kvtier inside SGLang (benchmarks/sglang_backend.py) with
# 32 KiB pages, from 16: 2631 pages/s to disk at 20.2 CPU-s per GiB and cold loads of
# 5149/s at 8.4; at 4: 4174/s at 12.7 and 7179/s at 4.8. At 768 KiB pages the deeper
# start won on both (to disk 1.44 against 1.04 GB/s at 0.61 against 0.76 s per GiB).
DEEP_START_BYTES = 256 << 10
# The most an adaptive write depth goes up to: vLLM's tiering writes on all 32 of its
# threads while nothing is read (each takes the other queue when its own is empty).
# Reads stop at DEFAULT_MAX_DEPTH, which also sizes a local tier's promotion batches.
MAX_WRITE_DEPTH = 32


@dataclass(frozen=True)
class FsSettings:
    """The fs tier's parameters (``{"type": "fs", "root_dir": ...}``)."""

    #: The directory under which each namespace gets a directory of its own. Required;
    #: ``~`` is expanded when the tier is built. Created at start if it is missing, but
    #: only if its parent exists: a missing parent is an error.
    root_dir: Path
    #: Bytes of chunk files the tier keeps; beyond it the least recently used files are
    #: removed. None (the default): no limit but the filesystem's.
    capacity_bytes: int | None = None
    #: Chunk files read at once: ``"auto"`` (the default) adapts the depth to what the
    #: disk delivers, starting at 16 (4 for chunks under 256 KiB), between
    #: ``min_depth`` and ``max_read_depth``; a number fixes it. ``io_concurrency``
    #: sets this and ``write_depth`` together; either one given on its own wins over it.
    read_depth: int | Literal["auto"] = AUTO
    #: Chunk files written at once; see ``read_depth`` (bounded by ``max_write_depth``).
    write_depth: int | Literal["auto"] = AUTO
    #: The least an adaptive depth goes down to (2); a fixed depth ignores it.
    min_depth: int = DEFAULT_MIN_DEPTH
    #: The most an adaptive read depth goes up to (16, vLLM's read threads); a fixed
    #: one ignores it.
    max_read_depth: int = DEFAULT_MAX_DEPTH
    #: The most an adaptive write depth goes up to (32: vLLM's 16 read and 16 write
    #: threads all write while nothing is read).
    max_write_depth: int = MAX_WRITE_DEPTH
    #: Write and read without the page cache: ``"auto"`` where the filesystem supports
    #: it (probed at start), true to require it, false never.
    o_direct: bool | Literal["auto"] = "auto"
    #: Flush each file to the device before it becomes visible (false): a crash of the
    #: machine may otherwise leave files of the last seconds empty (they then fail
    #: verification and count as misses).
    fsync: bool = False
    #: Other processes or nodes may write to the same ``root_dir`` (true): a key the
    #: tier's index does not know is looked for on disk before it is called a miss.
    shared: bool = True

    @classmethod
    def from_params(cls, params: Mapping[str, Any], path: str) -> FsSettings:
        """Read the fs tier's parameters; errors name ``path.<parameter>``."""
        reader = ConfigReader(params, path)
        root_dir = Path(reader.string("root_dir"))
        capacity_bytes = reader.integer("capacity_bytes", None, minimum=1)
        both = _depth(reader, "io_concurrency", AUTO)
        read_depth = _depth(reader, "read_depth", both)
        write_depth = _depth(reader, "write_depth", both)
        min_depth = reader.integer("min_depth", DEFAULT_MIN_DEPTH, minimum=1, maximum=_MAX_DEPTH)
        max_read_depth = _bound(reader, "max_read_depth", min_depth, DEFAULT_MAX_DEPTH)
        max_write_depth = _bound(reader, "max_write_depth", min_depth, MAX_WRITE_DEPTH)
        o_direct = reader.raw("o_direct", "auto")
        if o_direct not in ("auto", True, False):
            raise ConfigError(reader.path_of("o_direct"), 'expected "auto", true or false')
        fsync = reader.boolean("fsync", False)
        shared = reader.boolean("shared", True)
        reader.reject_unknown()
        return cls(
            root_dir=root_dir,
            capacity_bytes=capacity_bytes,
            read_depth=read_depth,
            write_depth=write_depth,
            min_depth=min_depth,
            max_read_depth=max_read_depth,
            max_write_depth=max_write_depth,
            o_direct=o_direct,
            fsync=fsync,
            shared=shared,
        )

    @property
    def read_range(self) -> DepthRange:
        """The read depths the tier may run at."""
        return _range(self.read_depth, self.min_depth, self.max_read_depth)

    @property
    def write_range(self) -> DepthRange:
        """The write depths the tier may run at."""
        return _range(self.write_depth, self.min_depth, self.max_write_depth)


def _depth(reader: ConfigReader, key: str, default: int | Literal["auto"]) -> int | Literal["auto"]:
    """A depth setting: ``"auto"`` or a number of operations in flight."""
    value = reader.raw(key)
    if value is None:
        return default
    if value == AUTO:
        return AUTO
    if isinstance(value, str):
        raise ConfigError(reader.path_of(key), f'expected "auto" or an integer, got {value!r}')
    depth: int = reader.integer(key, default, minimum=1, maximum=_MAX_DEPTH)
    return depth


def _bound(reader: ConfigReader, key: str, min_depth: int, default: int) -> int:
    """``max_read_depth`` / ``max_write_depth``, no lower than ``min_depth``."""
    value: int = reader.integer(key, default, minimum=1, maximum=_MAX_DEPTH)
    if value < min_depth:
        raise ConfigError(
            reader.path_of(key), f"expected a value >= min_depth ({min_depth}), got {value}"
        )
    return value


def _starting(depths: DepthRange, chunk_bytes: int) -> DepthRange:
    """``depths`` for chunks of ``chunk_bytes``: an adaptive range starts lower for
    chunks under :data:`DEEP_START_BYTES`."""
    if depths.is_fixed or chunk_bytes >= DEEP_START_BYTES:
        return depths
    return DepthRange.adaptive(depths.minimum, depths.maximum, DEFAULT_START_DEPTH)


def _range(depth: int | str, minimum: int, maximum: int) -> DepthRange:
    if isinstance(depth, int):
        return DepthRange.fixed(depth)
    return DepthRange.adaptive(minimum, maximum, START_DEPTH)


class FileSystemTier(SecondaryTier):
    """Chunks as files on a local or shared filesystem (parameters: :class:`FsSettings`)."""

    medium = Medium.STORAGE
    locality = "local"
    settings_class = FsSettings

    def __init__(self, ctx: TierContext, **params: Any) -> None:
        super().__init__(ctx)
        self.settings = FsSettings.from_params(params, ctx.config_path)
        self._format = ChunkFormat(ctx.namespace)
        self.directory = self.settings.root_dir.expanduser() / namespace_directory(
            ctx.model_name, self._format
        )
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
            _starting(self.settings.read_range, ctx.chunk_bytes),
            depth_gauge(metrics, name, "read"),
            name=f"kvtier-{name}-read",
        )
        self._writes = IoDepth(
            _starting(self.settings.write_range, ctx.chunk_bytes),
            depth_gauge(metrics, name, "write"),
            name=f"kvtier-{name}-write",
        )
        self._tasks = TaskSet(f"tier {ctx.tier_name}")
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
        root = self.settings.root_dir.expanduser()
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
        supported = await anyio.to_thread.run_sync(self._o_direct_works)
        if self.settings.o_direct is True and not supported:
            raise ConfigError(
                f"{self.ctx.config_path}.o_direct",
                f"the filesystem of {self.directory} does not support O_DIRECT",
            )
        return supported

    def _o_direct_works(self) -> bool:
        if not _O_DIRECT:
            return False
        probe = self.directory / temp_name(".o_direct_probe")
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
                    if name.endswith(TEMP_SUFFIX):
                        if now - st.st_mtime > STALE_TMP_S:
                            with contextlib.suppress(OSError):
                                os.unlink(entry.path)
                        continue
                    key = key_of(name)
                    if key is not None:
                        found.append((key, st.st_size, st.st_mtime))
        return found

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
            flags |= _O_DIRECT
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
            listed = await anyio.to_thread.run_sync(self._list_files)
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
        corrupt = {k: r for k, r in outcomes.items() if r is not None and r != MISSING}
        await self._corrupt.discard(corrupt, f"promotion job {job.job_id}", self._remove)
        self._forget(lost)
        return JobResult(job.job_id, not lost, successful_keys=loaded)

    def _read_chunk(self, chunk: tuple[OffloadKey, memoryview]) -> tuple[OffloadKey, str | None]:
        """Read one chunk; its key and :meth:`_read_file`'s answer. Runs in a thread."""
        key, row = chunk
        return key, self._read_file(key, row)

    def _read_file(self, key: OffloadKey, row: memoryview) -> str | None:
        """Read and verify one chunk into ``row``: None, ``MISSING``, or what was wrong.

        Runs in a thread.
        """
        path = self._file(key)
        expected = HEADER_BYTES + len(row)
        try:
            stat, got, header = self._read_into(path, row, expected, self.o_direct)
        except FileNotFoundError:
            return MISSING
        if got < expected or stat.st_size != expected:
            problem: str | None = "truncated file" if got < expected else "trailing bytes"
        else:
            problem = self._format.verify(memoryview(header), key, row)
        if problem is None and time.time() - stat.st_mtime > MTIME_REFRESH_S:
            # Loads refresh the modification time: it orders eviction after a restart.
            with contextlib.suppress(OSError):
                os.utime(path)
        return problem

    @staticmethod
    def _read_into(
        path: str, row: memoryview, expected: int, direct: bool
    ) -> tuple[os.stat_result, int, mmap.mmap | bytearray]:
        """Read a chunk file's header and payload (into ``row``); its status, the bytes
        read and the header.

        With ``direct`` the bytes go from the device straight into the region's slot,
        past the page cache: measured on the project's VM disk, cold O_DIRECT reads at
        depth 4 ran at 0.47 GB/s against 0.22 GB/s buffered, and 1.4 against 0.85 GB/s
        at depth 16, at a fraction of the CPU (no page-cache copy). The slot is
        page-aligned and the header page too, as O_DIRECT requires.
        """
        flags = os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
        fd = os.open(path, flags)
        header = aligned_header() if direct else bytearray(HEADER_BYTES)
        try:
            stat = os.fstat(fd)
            got = read_all(fd, [memoryview(header), row], expected)
        finally:
            os.close(fd)
        return stat, got, header

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
