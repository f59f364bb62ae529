"""The primary tier's memory: one shared-memory region per engine.

The region is a file in ``/dev/shm`` (``kvtier_<engine_id>.mmap``, mode 0600) that the
scheduler process and every worker process map. Row ``i`` holds chunk slot ``i``;
inside a row each worker rank owns one contiguous column::

    header page | row 0: | rank0 | rank1 | ... | pad |
                | row 1: | rank0 | rank1 | ... | pad |

A region with a shared column has one column per row that every rank works on: the
one copy of bytes all ranks hold alike, or a canonical page each rank writes its
fragments of (see :class:`~kvtier.config.OffloadingConfig`'s ``layout``).

A worker copies GPU blocks straight into its column (one copy) and a secondary tier
reads or writes whole rows straight from the mapping (one copy); no bytes travel
between processes.

Lifecycle. The first process creates the file under a temporary name, takes a shared
``flock`` on it and only then links it under its real name, so a visible region always
has a live owner. Others open it, wait (bounded) until the creator has sized and
prefaulted it, check that its layout matches theirs, and mark their seat in the header.
The moment every expected process (the scheduler plus ``world_size`` workers) has
mapped it, the name is unlinked: from then on the memory lives exactly as long as the
mappings, so a crash of any process leaks nothing. If the engine stops before everyone
joined, the last process to leave unlinks the name. A name left behind by processes
that died before everyone joined holds no lock any more; the next process to open it,
or to create any region in the same directory, sees that and removes it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import struct
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier._region_rows import PrimaryView
from kvtier.config import PAGE_SIZE, ChunkGeometry
from kvtier.errors import RegionError
from kvtier.resources import BlockingResource

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_SHM_DIR", "PrimaryView", "SharedOffloadRegion", "region_path", "sweep_orphans"]

logger = logging.getLogger(__name__)

DEFAULT_SHM_DIR = "/dev/shm"

_MAGIC = b"KVTIERRG"
_LAYOUT_VERSION = 1
# magic, layout version, world size, chunks, chunk bytes, column bytes, ready, shared column
_HEADER = struct.Struct("<8sIIQQQII")
_READY_OFFSET = 40
_SEATS_OFFSET = 64
_HEADER_BYTES = PAGE_SIZE
# MADV_POPULATE_WRITE (Linux 5.14) is missing from Python's mmap module before 3.12.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# Joiners poll the header while the creator sizes and prefaults the region. Prefaulting
# runs at ~1-3 GB/s here, so tens of GiB take seconds; 5 ms polls cost nothing.
_JOIN_POLL_S = 0.005
# A warning names this many slots still in use: enough to look one up, few enough for
# one line whatever the region's size.
_SLOTS_NAMED = 8


def region_path(engine_id: str, shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> Path:
    """Where the region of ``engine_id`` lives while processes are joining it."""
    return Path(shm_dir) / f"kvtier_{engine_id}.mmap"


class SharedOffloadRegion(BlockingResource):
    """One process's mapping of an engine's primary region.

    ``rank=None`` opens the scheduler side (whole rows: :attr:`rows`,
    :attr:`primary_view`); ``rank=r`` opens worker ``r``'s side
    (:meth:`worker_column`). Both sides may live in one process.

    Raises:
        RegionError: the region cannot be created (not enough shared memory), an
            existing one has another layout, the rank's seat is taken, or the creator
            did not finish preparing it within ``join_timeout`` seconds.
    """

    def __init__(
        self,
        engine_id: str,
        *,
        num_chunks: int,
        chunk_bytes: int,
        column_bytes: int,
        world_size: int,
        rank: int | None,
        shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
        join_timeout: float = 30.0,
        shared_column: bool = False,
    ) -> None:
        if num_chunks < 1 or chunk_bytes < 1 or column_bytes < 1 or world_size < 1:
            raise ValueError("a region needs at least one chunk, row, column and worker")
        if chunk_bytes % PAGE_SIZE:
            raise ValueError(f"chunk_bytes must be a multiple of the page size {PAGE_SIZE}")
        columns = 1 if shared_column else world_size
        if column_bytes * columns > chunk_bytes:
            raise ValueError(
                f"{columns} columns of {column_bytes} bytes do not fit a {chunk_bytes}-byte row"
            )
        if rank is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}) or None, got {rank}")
        if _SEATS_OFFSET + 1 + world_size > _HEADER_BYTES:
            raise ValueError(f"world_size {world_size} does not fit the region header")
        self.engine_id = engine_id
        self.num_chunks = num_chunks
        self.chunk_bytes = chunk_bytes
        self.column_bytes = column_bytes
        self.world_size = world_size
        self.shared_column = shared_column
        self.rank = rank
        self.path = region_path(engine_id, shm_dir)
        self.nbytes = _HEADER_BYTES + num_chunks * chunk_bytes
        self.is_creator = False
        self._fd: int | None = None
        self._mmap: mmap.mmap | None = None
        # A mapping that close() could not unmap, while views of it keep it alive.
        self._left_mapped: weakref.ref[mmap.mmap] | None = None
        self._view: memoryview | None = None
        self._data: memoryview | None = None
        self._rows: memoryview | None = None
        self._primary_view: PrimaryView | None = None
        self._column: torch.Tensor | None = None
        self._inode: tuple[int, int] | None = None
        self._seat: int | None = None
        try:
            self._open(join_timeout)
        except BaseException:
            self.close()
            raise

    @classmethod
    def for_geometry(
        cls,
        engine_id: str,
        geometry: ChunkGeometry,
        rank: int | None,
        *,
        shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
        join_timeout: float = 30.0,
    ) -> SharedOffloadRegion:
        return cls(
            engine_id,
            num_chunks=geometry.num_chunks,
            chunk_bytes=geometry.chunk_bytes,
            column_bytes=geometry.column_bytes,
            world_size=geometry.world_size,
            rank=rank,
            shm_dir=shm_dir,
            join_timeout=join_timeout,
            shared_column=geometry.shared_column,
        )

    # ------------------------------------------------------------------ views

    @property
    def closed(self) -> bool:
        return self._mmap is None

    @property
    def mapped(self) -> bool:
        """Whether this process maps the region: until close, and after it while views
        handed out earlier are still referenced (the mapping goes with the last)."""
        if self._mmap is not None:
            return True
        return self._left_mapped is not None and self._left_mapped() is not None

    @property
    def rows(self) -> memoryview:
        """The scheduler's view: a 2-D memoryview ``(num_chunks, chunk_bytes)``."""
        self._require_scheduler_side("rows")
        assert self._rows is not None
        return self._rows

    @property
    def primary_view(self) -> PrimaryView:
        """Rows by slot, for secondary tiers (``view[chunk_id]`` -> row memoryview)."""
        self._require_scheduler_side("primary_view")
        assert self._primary_view is not None
        return self._primary_view

    def worker_column(self) -> torch.Tensor:
        """This rank's column: a ``uint8`` tensor ``(num_chunks, column_bytes)``.

        Its rows are strided by ``chunk_bytes``, so copies land directly in the shared
        mapping. Only a worker side (``rank`` set) has one; with a shared column every
        rank's is the same.
        """
        if self.rank is None:
            raise RegionError("the scheduler side of a region has no worker column")
        if self._column is None:
            import torch

            view = self._require_view()
            base = torch.frombuffer(view, dtype=torch.uint8)
            self._column = torch.as_strided(
                base,
                size=(self.num_chunks, self.column_bytes),
                stride=(self.chunk_bytes, 1),
                storage_offset=_HEADER_BYTES
                + (0 if self.shared_column else self.rank) * self.column_bytes,
            )
        return self._column

    def mapping_address(self) -> tuple[int, int]:
        """``(address, length)`` of this process's whole mapping, for host registration."""
        import ctypes

        view = self._require_view()
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        return address, self.nbytes

    # -------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Leave the region: give up the seat, unmap and release the lock.

        The last process to leave a region that not everyone joined unlinks its name,
        as does a creator that fails before the region is ready. Idempotent. Views
        handed out earlier must not be used afterwards.
        """
        self._column = None
        slots_in_use = [] if self._primary_view is None else self._primary_view.slots_in_use()
        for view in (self._rows, self._data, self._view):
            if view is not None:
                with contextlib.suppress(BufferError):
                    view.release()
        self._rows = None
        self._data = None
        self._view = None
        self._primary_view = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # The mapping goes when the last view of it does.
                self._left_mapped = weakref.ref(self._mmap)
                logger.warning(
                    "region %s stays mapped after close (%.2f GiB): %s still referenced; "
                    "a traceback kept by an exception or a log record may hold them",
                    self.path,
                    self.nbytes / 2**30,
                    self._holders(slots_in_use),
                )
            self._mmap = None
        if self._fd is not None:
            if self._seat is not None:
                os.pwrite(self._fd, b"\0", self._seat)
                seats = os.pread(self._fd, 1 + self.world_size, _SEATS_OFFSET)
                if not any(seats):
                    self._unlink_if_ours()
                self._seat = None
            elif self.is_creator:
                self._unlink_if_ours()
            os.close(self._fd)
            self._fd = None

    def _holders(self, slots_in_use: list[int]) -> str:
        """What may still hold views of the mapping, as far as this side knows."""
        if not slots_in_use:
            return "views of its mapping are"
        shown = ", ".join(str(slot) for slot in slots_in_use[:_SLOTS_NAMED])
        more = ", ..." if len(slots_in_use) > _SLOTS_NAMED else ""
        return f"{len(slots_in_use)} row view(s) handed to tiers (slots {shown}{more}) are"

    def __repr__(self) -> str:
        side = "scheduler" if self.rank is None else f"rank {self.rank}"
        state = "closed" if self.closed else "open"
        return (
            f"<SharedOffloadRegion {self.engine_id!r} {side} {self.num_chunks}x"
            f"{self.chunk_bytes}B {state}>"
        )

    # ---------------------------------------------------------------- opening

    def _open(self, join_timeout: float) -> None:
        deadline = time.monotonic() + join_timeout
        while True:
            if self._try_create():
                return
            fd = self._try_open_existing()
            if fd is None:
                continue  # the name vanished or was reclaimed: start over
            self._fd = fd
            self._join(deadline)
            return

    def _try_create(self) -> bool:
        """Create the region; False if another process already has one under the name."""
        sweep_orphans(self.path.parent, keep=self.path)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileNotFoundError as exc:
            raise RegionError(f"shared-memory directory {self.path.parent} does not exist") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, _HEADER_BYTES)
            os.pwrite(fd, self._header_bytes(ready=False), 0)
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                os.close(fd)
                return False
        finally:
            os.unlink(tmp)
        self._fd = fd
        self._inode = _inode_of_fd(fd)
        self.is_creator = True
        self._allocate()
        self._map()
        self._prefault()
        assert self._mmap is not None
        self._mmap[_READY_OFFSET : _READY_OFFSET + 4] = struct.pack("<I", 1)
        self._take_seat()
        logger.info("created shared region %s (%.2f GiB)", self.path, self.nbytes / 2**30)
        return True

    def _allocate(self) -> None:
        assert self._fd is not None
        free = _free_bytes(self.path.parent)
        if free is not None and free < self.nbytes:
            raise RegionError(
                f"{self.path.parent} has {free} bytes free, the region needs {self.nbytes}: "
                "lower cpu_bytes_to_use or enlarge the shared-memory filesystem"
            )
        try:
            os.ftruncate(self._fd, self.nbytes)
            # Allocating every page now turns a too-small /dev/shm into this error
            # instead of a SIGBUS in the middle of a copy.
            os.posix_fallocate(self._fd, 0, self.nbytes)
        except OSError as exc:
            reason = os.strerror(exc.errno or 0)
            raise RegionError(
                f"cannot allocate {self.nbytes} bytes for {self.path}: {reason}"
            ) from exc

    def _try_open_existing(self) -> int | None:
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # Someone holds it: the region is alive. Join with a shared lock.
            fcntl.flock(fd, fcntl.LOCK_SH)
        else:
            # No process holds the region: its creator died before everyone joined.
            if _inode_of_path(self.path) == _inode_of_fd(fd):
                logger.warning("reclaiming %s, left behind by a process that died", self.path)
                _unlink_quietly(self.path)
            os.close(fd)
            return None
        if _inode_of_path(self.path) != _inode_of_fd(fd):
            os.close(fd)
            return None
        return fd

    def _join(self, deadline: float) -> None:
        assert self._fd is not None
        self._inode = _inode_of_fd(self._fd)
        header = self._wait_until_ready(deadline)
        expected = self._header_bytes(ready=True)
        if header != expected:
            raise RegionError(
                f"{self.path} has another layout ({_describe(header)}) than this process "
                f"expects ({_describe(expected)}): the scheduler and workers must share one config"
            )
        self._map()
        self._prefault()
        self._take_seat()

    def _wait_until_ready(self, deadline: float) -> bytes:
        assert self._fd is not None
        while True:
            header = os.pread(self._fd, _HEADER.size, 0)
            if (
                len(header) == _HEADER.size
                and header[:8] == _MAGIC
                and struct.unpack_from("<I", header, _READY_OFFSET)[0] == 1
            ):
                return header
            if time.monotonic() > deadline:
                raise RegionError(f"timed out waiting for the creator of {self.path} to prepare it")
            time.sleep(_JOIN_POLL_S)

    def _map(self) -> None:
        assert self._fd is not None
        self._mmap = mmap.mmap(
            self._fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        self._view = memoryview(self._mmap)
        if self.rank is None:
            self._data = self._view[_HEADER_BYTES:]
            self._rows = self._data.cast("B", (self.num_chunks, self.chunk_bytes))
            self._primary_view = PrimaryView(self._data, self.num_chunks, self.chunk_bytes)

    def _prefault(self) -> None:
        """Map every page now: first-touch writes into fresh pages run ~10x slower."""
        assert self._mmap is not None
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE, 0, self.nbytes)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise RegionError(f"cannot prefault {self.path}: {exc}") from exc
            # Older kernels: fault the pages by reading one byte of each.
            view = self._require_view()
            for offset in range(0, self.nbytes, PAGE_SIZE):
                view[offset]

    def _take_seat(self) -> None:
        assert self._mmap is not None
        seat = _SEATS_OFFSET + (0 if self.rank is None else 1 + self.rank)
        if self._mmap[seat]:
            who = "the scheduler" if self.rank is None else f"rank {self.rank}"
            raise RegionError(f"{who} of engine {self.engine_id!r} has already joined {self.path}")
        self._mmap[seat] = 1
        self._seat = seat
        seats = self._mmap[_SEATS_OFFSET : _SEATS_OFFSET + 1 + self.world_size]
        if all(seats):
            self._unlink_if_ours()

    # ---------------------------------------------------------------- helpers

    def _header_bytes(self, *, ready: bool) -> bytes:
        return _HEADER.pack(
            _MAGIC,
            _LAYOUT_VERSION,
            self.world_size,
            self.num_chunks,
            self.chunk_bytes,
            self.column_bytes,
            1 if ready else 0,
            1 if self.shared_column else 0,
        )

    def _require_view(self) -> memoryview:
        if self._view is None:
            raise RegionError(f"region {self.path} is closed")
        return self._view

    def _require_scheduler_side(self, what: str) -> None:
        if self.rank is not None:
            raise RegionError(f"{what} belongs to the scheduler side (rank=None) of a region")
        self._require_view()

    def _unlink_if_ours(self) -> None:
        if self._inode is not None and _inode_of_path(self.path) == self._inode:
            _unlink_quietly(self.path)


# A creator takes its lock on the temporary file right after creating it; give it this
# long before a temporary file without a lock counts as left by a dead process.
_TMP_GRACE_S = 10.0


def sweep_orphans(shm_dir: Path, keep: Path | None = None) -> list[Path]:
    """Remove region files of other engines that no live process holds.

    Every live participant holds a shared ``flock`` on its region file, so a file whose
    exclusive lock can be taken belongs to processes that all died before everyone had
    joined (after that the name is gone already). Returns what was removed.
    """
    removed: list[Path] = []
    try:
        candidates = list(shm_dir.glob("kvtier_*.mmap")) + list(shm_dir.glob("kvtier_*.mmap.*.tmp"))
    except OSError:
        return removed
    now = time.time()
    for path in candidates:
        if path == keep:
            continue
        try:
            if path.suffix == ".tmp" and now - path.stat().st_mtime < _TMP_GRACE_S:
                continue
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, or not ours to touch
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            if _inode_of_path(path) == _inode_of_fd(fd):
                _unlink_quietly(path)
                removed.append(path)
                logger.info("removed %s, left behind by processes that died", path)
        finally:
            os.close(fd)
    return removed


def _inode_of_fd(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _inode_of_path(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _free_bytes(directory: Path) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _describe(header: bytes) -> str:
    _, version, world_size, chunks, chunk_bytes, column_bytes, _, shared = _HEADER.unpack(header)
    columns = f"one shared {column_bytes}-byte column" if shared else f"{column_bytes}-byte columns"
    return (
        f"layout v{version}, {world_size} worker(s), {chunks} chunks of {chunk_bytes} bytes, "
        f"{columns}"
    )
