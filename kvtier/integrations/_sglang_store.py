"""The work behind kvtier's SGLang backend: pages to kvtier chunks and back, through
the manager's synchronous API (the public face and the design are in
:mod:`kvtier.integrations.sglang`)."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from kvtier.config import OffloadingConfig, storage_namespace
from kvtier.errors import ConfigError, KVTierError
from kvtier.keys import OffloadKey, make_offload_key
from kvtier.records import LookupResult, ReqContext
from kvtier.region import DEFAULT_SHM_DIR
from kvtier.resources import BlockingResource
from kvtier.specs.base import OffloadingSpec
from kvtier.specs.factory import OffloadingSpecFactory, with_spec_name
from kvtier.tiering.manager import TieringOffloadingManager

__all__ = [
    "IOSample",
    "PageStore",
    "Segment",
    "UnsupportedPoolError",
    "offloading_config",
    "page_key",
]

logger = logging.getLogger(__name__)

_HIT, _HIT_PENDING = LookupResult.HIT, LookupResult.HIT_PENDING
_MISS, _RETRY = LookupResult.MISS, LookupResult.RETRY

#: ``(address, nbytes)`` of one piece of a page in the caller's memory. A page is one
#: or more segments, concatenated in order into its chunk.
Segment = tuple[int, int]

# The longest a caller sleeps between looks at the tiers' progress. A completion is
# normally seen at once (the wait wakes on it); this only bounds the cost of one
# applied on the loop thread between a caller's look and the start of its wait, which
# the manager's blocking wait cannot see.
_WAIT_SLICE_S = 0.02

# How long a prefix found by contains_prefix keeps its request open for the load that
# normally follows, beyond twice the time the lookup was given: its queued promotions,
# its tier answers and the primary slots promoted for it (reserved for that request, so
# that nothing evicts them first). SGLang gives up on a prefetch after its own timeout
# (1 s plus 0.25 s per 1024 tokens by default) and never says so to the backend; a
# session past its lease lets go of what it holds, and a load that comes later still
# works: it looks the keys up again.
_SESSION_GRACE_S = 5.0


class UnsupportedPoolError(KVTierError):
    """SGLang registered a host pool whose pages kvtier cannot store (raised by the
    backend while SGLang attaches it, which then fails with this message)."""


def page_key(page_hash: str) -> OffloadKey:
    """The kvtier key of an SGLang page: its 64-hex-digit chained hash as bytes.

    A name that is not hex (no SGLang KV page has one) is used as its UTF-8 bytes.
    """
    try:
        raw = bytes.fromhex(page_hash)
    except ValueError:
        raw = page_hash.encode()
    return make_offload_key(raw or b"\0")


def offloading_config(
    kvtier_config: Mapping[str, Any],
    *,
    engine_id: str,
    page_tokens: int,
    page_bytes: int,
    model_name: str,
    kv_format: str,
    shard: str = "",
    config_path: str = "kvtier",
) -> OffloadingConfig:
    """The kvtier configuration of one SGLang rank.

    ``kv_format`` names what the bytes of a page mean beyond the model (KV dtype, host
    pool kind, memory layout); ``shard`` which part of the model's KV this rank holds
    (tensor- and pipeline-parallel rank and size; empty when every rank holds the same
    bytes, as MLA ranks do). Both go into the storage namespace, so ranks, layouts and
    models never read each other's chunks.

    Raises:
        ConfigError: ``kvtier_config`` is not a mapping, or sets ``block_size`` to
            another size than the page (the rest is checked when the spec is built).
    """
    if not isinstance(kvtier_config, Mapping):
        raise ConfigError(
            config_path, f"expected a mapping of kvtier settings, got {type(kvtier_config)}"
        )
    extra = with_spec_name(kvtier_config)
    block_size = extra.setdefault("block_size", page_tokens)
    if block_size != page_tokens:
        raise ConfigError(
            f"{config_path}.block_size",
            f"one SGLang page is one kvtier chunk: expected {page_tokens} (the page "
            f"size) or no block_size, got {block_size!r}",
        )
    return OffloadingConfig(
        engine_id=engine_id,
        kv_bytes_per_block=page_bytes,
        tokens_per_block=page_tokens,
        world_size=1,
        rank=0,
        model_name=f"{model_name}@{shard}" if shard else model_name,
        kv_dtype=kv_format,
        extra_config=extra,
    )


@dataclass(frozen=True, slots=True)
class IOSample:
    """One load or store call: pages moved, their bytes, and its wall time."""

    pages: int
    nbytes: int
    seconds: float


@dataclass(eq=False)
class _Session:
    """A prefix :meth:`PageStore.contains_prefix` found, kept for the load after it.

    One load at a time uses a session (``busy``): two calls sharing a request would
    release each other's pins when the session ends.
    """

    req: ReqContext
    keys: set[OffloadKey]
    expires: float
    busy: bool = False


# Load and store samples kept for take_io_samples. SGLang takes them at every scheduler
# step when its storage metrics are on, and never when they are off: the newest this
# many are kept, so a server without metrics does not grow.
_MAX_IO_SAMPLES = 4096


def _samples() -> deque[IOSample]:
    return deque(maxlen=_MAX_IO_SAMPLES)


@dataclass
class _Counts:
    """Cumulative page counts, for :meth:`PageStore.stats`."""

    queried: int = 0
    found: int = 0
    loaded: int = 0
    load_misses: int = 0
    stored: int = 0
    already_stored: int = 0
    store_failures: int = 0
    load_samples: deque[IOSample] = field(default_factory=_samples)
    store_samples: deque[IOSample] = field(default_factory=_samples)


class _Gate:
    """Calls run side by side; :meth:`fenced` (reset, close) runs alone.

    A call entering once the store is closed gets ``False`` and answers as a miss: SGLang
    stops its threads before it closes a backend, but a stray call must not touch an
    unmapped region.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._fenced = False
        self.closed = False

    @property
    def active(self) -> int:
        """Calls in flight now."""
        return self._active

    @contextlib.contextmanager
    def call(self) -> Iterator[bool]:
        with self._cond:
            self._cond.wait_for(lambda: not self._fenced)
            if self.closed:
                yield False
                return
            self._active += 1
        try:
            yield True
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def fenced(self) -> Iterator[bool]:
        """Wait for the calls in flight (each ends by its deadline), hold new ones."""
        with self._cond:
            self._cond.wait_for(lambda: not self._fenced)
            self._fenced = True
            self._cond.wait_for(lambda: self._active == 0)
        try:
            yield not self.closed
        finally:
            with self._cond:
                self._fenced = False
                self._cond.notify_all()


class PageStore(BlockingResource):
    """kvtier's tiers as a store of fixed-size pages, for a synchronous multi-threaded host.

    Builds the spec ``config.extra_config`` selects with
    :meth:`OffloadingSpecFactory.create_spec` and its manager for a synchronous host
    (the tiers on a loop thread of the manager's own). One page is one chunk of
    ``config.kv_bytes_per_block`` bytes; the caller hands its pages as segments of its
    own memory (:data:`Segment`), which must stay valid for the call.

    Every method may be called from any thread, concurrently; each waits only for the
    tier work it asked for and returns by its ``timeout``. Tier failures, corrupt or
    missing chunks and time-outs are misses, never exceptions and never wrong bytes:
    a page is copied out only from a primary slot the request pins, which holds
    verified bytes.
    """

    def __init__(
        self,
        config: OffloadingConfig,
        *,
        registry: CollectorRegistry | None = None,
        shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
    ) -> None:
        if config.world_size != 1:
            raise ConfigError("world_size", "a PageStore is one rank's: expected 1")
        self.config = config
        self.page_bytes = config.kv_bytes_per_block
        spec = OffloadingSpecFactory.create_spec(config, registry=registry, shm_dir=shm_dir)
        if spec.block_size != config.tokens_per_block:
            spec.shutdown()
            raise ConfigError(
                "block_size", f"one page is one chunk: expected {config.tokens_per_block}"
            )
        try:
            manager = spec.get_manager()
            # A region's /dev/shm name goes once every seat of it was taken. No worker
            # ever joins this one (the store copies through the scheduler side), so
            # taking the worker seat for a moment means a crash leaves nothing there.
            open_region = getattr(spec, "open_region", None)
            if open_region is not None:
                open_region(0).close()
        except BaseException:
            spec.shutdown()
            raise
        self.spec: OffloadingSpec = spec
        self.manager: TieringOffloadingManager = manager
        region = manager.region
        assert region is not None  # every built-in spec's manager has one
        self._rows = region.primary_view
        self._gate = _Gate()
        self._req_ids = itertools.count()
        #: Open sessions by each key they found (guarded by the manager's lock).
        self._sessions: dict[OffloadKey, _Session] = {}
        self._session_order: deque[_Session] = deque()
        self._counts = _Counts()
        self._counts_lock = threading.Lock()
        #: Store batches are at most half the primary tier, so that one batch never
        #: needs the whole tier (the other half may be pinned by loads in flight).
        self._store_batch = max(1, manager.host.num_chunks // 2)

    @property
    def namespace(self) -> str:
        """The storage namespace of the chunks (model, page format, shard, geometry)."""
        return storage_namespace(self.config, self.spec.settings.geometry)

    @property
    def registry(self) -> CollectorRegistry:
        """The Prometheus registry kvtier's metrics are on."""
        return self.manager.metrics.registry

    @property
    def closed(self) -> bool:
        return self._gate.closed

    # -------------------------------------------------------------- lookups

    def contains_prefix(self, keys: Sequence[OffloadKey], timeout: float) -> int:
        """How many leading ``keys`` some tier holds; their promotions start now.

        Waits for the tiers' answers (never for the promotions), at most ``timeout``
        seconds; keys still unanswered then end the prefix. The prefix found stays with
        its request for the :meth:`load` that normally follows.
        """
        with self._gate.call() as open_:
            if not open_:
                return 0
            self._expire_sessions()
            if not keys:
                return 0
            deadline = time.monotonic() + timeout
            req = self._new_request()
            manager = self.manager
            while True:
                with manager.lock:
                    mark = manager.host.completion_mark
                    found, asking = self._scan(keys, req)
                    manager.on_schedule_end()
                if not asking or not self._wait(deadline, mark):
                    break
            self._count(queried=len(keys), found=found)
            if found == 0:
                manager.on_request_finished(req)
                return 0
            self._open_session(req, keys[:found], 2 * timeout + _SESSION_GRACE_S)
            return found

    def _scan(self, keys: Sequence[OffloadKey], req: ReqContext) -> tuple[int, bool]:
        """Look ``keys`` up in order (under the lock): the leading hits, and whether a
        tier is still being asked about a key before the first miss."""
        lookup = self.manager.lookup
        found = -1
        asking = False
        for index, key in enumerate(keys):
            result = lookup(key, req)
            if result is _HIT or result is _HIT_PENDING:
                continue
            if found < 0:
                found = index
            if result is _MISS:
                break
            asking = True
        return (len(keys) if found < 0 else found), asking

    # ---------------------------------------------------------------- loads

    def load(
        self,
        keys: Sequence[OffloadKey],
        pages: Sequence[Sequence[Segment]],
        timeout: float,
    ) -> list[bool]:
        """Copy the pages of ``keys`` into the caller's ``pages``; which arrived.

        Pages are copied as their chunks become readable in the primary tier, each once,
        from a slot the request pins. A key no tier holds (or whose chunk failed
        verification) ends the run: later pages are not looked up. Waits for
        promotions at most ``timeout`` seconds; what has not arrived is ``False``.
        The caller's memory of a page that is ``False`` is left as it was.
        """
        count = len(keys)
        self._check_pages(keys, pages)
        done = [False] * count
        if count == 0:
            return done
        with self._gate.call() as open_:
            if not open_:
                return done
            started = time.monotonic()
            deadline = started + timeout
            req, session = self._request_for(keys[0])
            manager = self.manager
            rows = self._rows
            whole = True
            try:
                while True:
                    with manager.lock:
                        mark = manager.host.completion_mark
                        ready, waiting, whole = self._ready(keys, done, req, whole)
                        manager.on_schedule_end()
                    if ready:
                        try:
                            for index, slot in ready:
                                _copy_out(rows[slot], pages[index])
                                done[index] = True
                        finally:
                            manager.complete_load([keys[index] for index, _ in ready], req)
                    if not waiting or not self._wait(deadline, mark):
                        break
            finally:
                self._end_load(req, session, keys)
            loaded = _leading(done)
            self._count(
                loaded=loaded,
                load_misses=count - loaded,
                load_sample=IOSample(loaded, loaded * self.page_bytes, time.monotonic() - started),
            )
            return done

    def _ready(
        self, keys: Sequence[OffloadKey], done: list[bool], req: ReqContext, whole: bool
    ) -> tuple[list[tuple[int, int]], bool, bool]:
        """Pin the keys readable now (under the lock): their (index, slot), whether a
        key before the first miss is still on its way, and whether the next look must
        be ``whole``.

        A ``whole`` look (a load's first) asks about every key up to the first miss: a
        key a tier has just said it holds starts its promotion only when it is looked
        up again, so while a tier is still being asked the next look is whole too.
        Otherwise every promotion is running, and a look stops at the first key still
        on its way: the keys after it count only once it has arrived.
        """
        manager = self.manager
        readable: list[int] = []
        waiting = asking = False
        for index, key in enumerate(keys):
            if done[index]:
                continue
            result = manager.lookup(key, req)
            if result is _HIT:
                readable.append(index)
            elif result is _MISS:
                break
            else:
                waiting = True
                asking = asking or result is _RETRY
                if not whole:
                    break
        if not readable:
            return [], waiting, asking
        slots = manager.prepare_load([keys[i] for i in readable], req).chunk_ids
        ready = list(zip(readable, (int(slot) for slot in slots), strict=True))
        return ready, waiting, asking

    # --------------------------------------------------------------- stores

    def store(
        self,
        keys: Sequence[OffloadKey],
        pages: Sequence[Sequence[Segment]],
        timeout: float,
    ) -> list[bool]:
        """Copy the caller's ``pages`` into the primary tier under ``keys``; which are
        stored (a key already stored counts). Cascades to the secondary tiers start at
        once and run on; the call does not wait for them.

        Waits for room in the primary tier (loads and cascades in flight hold slots) at
        most ``timeout`` seconds; keys that found none are ``False``.
        """
        count = len(keys)
        self._check_pages(keys, pages)
        stored = [False] * count
        if count == 0:
            return stored
        with self._gate.call() as open_:
            if not open_:
                return stored
            started = time.monotonic()
            deadline = started + timeout
            req = self._new_request()
            moved = 0
            try:
                for first in range(0, count, self._store_batch):
                    part = range(first, min(count, first + self._store_batch))
                    written = self._store_batch_of(keys, pages, part, req, deadline)
                    if written is None:
                        break
                    moved += written
                    for index in part:
                        stored[index] = True
            finally:
                self.manager.on_request_finished(req)
            ok = sum(stored)
            self._count(
                stored=moved,
                already_stored=ok - moved,
                store_failures=count - ok,
                store_sample=IOSample(moved, moved * self.page_bytes, time.monotonic() - started),
            )
            return stored

    def _store_batch_of(
        self,
        keys: Sequence[OffloadKey],
        pages: Sequence[Sequence[Segment]],
        part: range,
        req: ReqContext,
        deadline: float,
    ) -> int | None:
        """Store one batch; the pages newly written, or None if it found no room."""
        manager = self.manager
        batch = [keys[i] for i in part]
        while True:
            mark = manager.host.completion_mark
            if (out := manager.prepare_store(batch, req)) is not None:
                break
            if not self._room_may_come(mark) or not self._wait(deadline, mark):
                return None
            self._expire_sessions()
        if not out.keys_to_store:
            return 0
        position = {keys[i]: i for i in part}
        rows = self._rows
        success = False
        try:
            for key, slot in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                _copy_in(pages[position[key]], rows[int(slot)])
            success = True
        finally:
            manager.complete_store(out.keys_to_store, req, success=success)
        return len(out.keys_to_store)

    # ------------------------------------------------------------ sessions

    def _new_request(self) -> ReqContext:
        return ReqContext(f"sglang-{next(self._req_ids)}")

    def _open_session(self, req: ReqContext, keys: Sequence[OffloadKey], lease: float) -> None:
        session = _Session(req, set(keys), time.monotonic() + lease)
        with self.manager.lock:
            for key in keys:
                self._sessions[key] = session
            self._session_order.append(session)

    def _request_for(self, first: OffloadKey) -> tuple[ReqContext, _Session | None]:
        """The request of the session that found ``first``, else a new one."""
        with self.manager.lock:
            session = self._sessions.get(first)
            if session is not None and session.keys and not session.busy:
                session.busy = True
                return session.req, session
        return self._new_request(), None

    def _end_load(
        self, req: ReqContext, session: _Session | None, keys: Sequence[OffloadKey]
    ) -> None:
        """A load ended: its keys leave the session, which ends once it has none."""
        manager = self.manager
        if session is None:
            manager.on_request_finished(req)
            return
        with manager.lock:
            session.busy = False
            for key in keys:
                session.keys.discard(key)
                if self._sessions.get(key) is session:
                    del self._sessions[key]
            if session.keys:
                return
        manager.on_request_finished(req)

    def _expire_sessions(self) -> None:
        """End the sessions whose load never came (SGLang dropped the prefetch)."""
        now = time.monotonic()
        expired: list[_Session] = []
        with self.manager.lock:
            order = self._session_order
            # Oldest first; a session a load is using now is ended by that load.
            while order and (not order[0].keys or (order[0].expires <= now and not order[0].busy)):
                session = order.popleft()
                if session.keys:
                    expired.append(session)
                    self._forget(session)
        for session in expired:
            self.manager.on_request_finished(session.req)

    def _forget(self, session: _Session) -> None:
        for key in session.keys:
            if self._sessions.get(key) is session:
                del self._sessions[key]
        session.keys.clear()

    def _end_sessions(self) -> None:
        """End every session (no load is running: the caller holds the fence)."""
        with self.manager.lock:
            sessions = [s for s in self._session_order if s.keys]
            for session in sessions:
                self._forget(session)
            self._session_order.clear()
        for session in sessions:
            self.manager.on_request_finished(session.req)

    # --------------------------------------------------------------- helpers

    def _room_may_come(self, since: int) -> bool:
        """Whether a store refused after the completion mark ``since`` may find room
        by waiting: something completed after the mark (a cascade that ended after
        the refusal; the wait from the mark then ends at once), or something holding
        primary slots will let go of them: tier work in flight, another call (a load
        copying out of pinned slots), or a session keeping promoted slots for its load."""
        manager = self.manager
        return (
            manager.host.completed_since(since)
            or manager.has_pending_work()
            or self._gate.active > 1
            or bool(self._sessions)
        )

    def _wait(self, deadline: float, since: int) -> bool:
        """Wait for tier work to finish after the completion mark ``since``, at most
        until ``deadline``; False once past it."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self.manager.host.wait_for_completions_blocking(min(remaining, _WAIT_SLICE_S), since)
        return time.monotonic() < deadline

    def _check_pages(self, keys: Sequence[OffloadKey], pages: Sequence[Sequence[Segment]]) -> None:
        if len(pages) != len(keys):
            raise ValueError(f"{len(keys)} key(s) need as many pages, got {len(pages)}")
        for index, segments in enumerate(pages):
            size = sum(nbytes for _, nbytes in segments)
            if size != self.page_bytes:
                raise ValueError(
                    f"page {index} has {size} bytes in its segments, a chunk holds "
                    f"{self.page_bytes}"
                )

    def _count(
        self,
        *,
        load_sample: IOSample | None = None,
        store_sample: IOSample | None = None,
        **counts: int,
    ) -> None:
        with self._counts_lock:
            record = self._counts
            for name, value in counts.items():
                setattr(record, name, getattr(record, name) + value)
            if load_sample is not None and load_sample.pages:
                record.load_samples.append(load_sample)
            if store_sample is not None and store_sample.pages:
                record.store_samples.append(store_sample)

    # ----------------------------------------------------------------- public

    def stats(self) -> dict[str, int]:
        """Cumulative page counts: ``queried`` / ``found`` (prefix lookups),
        ``loaded`` / ``load_misses``, ``stored`` / ``already_stored`` /
        ``store_failures``."""
        with self._counts_lock:
            record = self._counts
            return {
                name: getattr(record, name)
                for name in (
                    "queried",
                    "found",
                    "loaded",
                    "load_misses",
                    "stored",
                    "already_stored",
                    "store_failures",
                )
            }

    def take_io_samples(self) -> tuple[list[IOSample], list[IOSample]]:
        """The (loads, stores) that moved pages since the last call."""
        with self._counts_lock:
            record = self._counts
            loads, stores = list(record.load_samples), list(record.store_samples)
            record.load_samples.clear()
            record.store_samples.clear()
        return loads, stores

    def reset(self) -> None:
        """Empty the primary tier; the secondary tiers keep their chunks.

        Waits for the calls in flight (each ends by its deadline) and for the tier work
        in flight; calls made meanwhile wait.
        """
        self._empty(tiers=False)

    def clear(self) -> list[str]:
        """Empty the primary tier, then ask every secondary tier to drop its chunks;
        the labels of the tiers that kept some. Waits as :meth:`reset` does."""
        return self._empty(tiers=True)

    def _empty(self, *, tiers: bool) -> list[str]:
        with self._gate.fenced() as open_:
            if not open_:
                return []
            self._end_sessions()
            self.manager.reset_cache()
            return self.manager.clear_tiers() if tiers else []

    def close(self) -> None:
        """Let the calls in flight end, then drain and close the tiers and the region.

        Idempotent; later calls answer as misses.
        """
        with self._gate.fenced() as open_:
            if not open_:
                return
            self._gate.closed = True
            try:
                self._end_sessions()
            finally:
                self.spec.close()


def _leading(flags: Sequence[bool]) -> int:
    for count, flag in enumerate(flags):
        if not flag:
            return count
    return len(flags)


def _row_address(row: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(row))


def _copy_out(row: memoryview, segments: Sequence[Segment]) -> None:
    """A primary row's leading bytes into the page's segments, in order (one copy).

    ctypes releases the interpreter lock for the copy, so other threads (kvtier's tier
    loop among them) run meanwhile.
    """
    base = _row_address(row)
    offset = 0
    for address, nbytes in segments:
        ctypes.memmove(address, base + offset, nbytes)
        offset += nbytes


def _copy_in(segments: Sequence[Segment], row: memoryview) -> None:
    """The page's segments, in order, into a primary row's leading bytes (one copy)."""
    base = _row_address(row)
    offset = 0
    for address, nbytes in segments:
        ctypes.memmove(base + offset, address, nbytes)
        offset += nbytes
