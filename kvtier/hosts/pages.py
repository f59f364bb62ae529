"""``PageStore``: kvtier's tiers as a store of fixed-size pages, for a synchronous host.

An engine whose threads call its storage synchronously (SGLang's HiCache controllers
are one) hands kvtier pages of its own memory: one page is one chunk. Bytes move with
one copy each way between the caller's memory and kvtier's primary slots.

What "stored" means is the host's choice (``lasting_acks``): by default a page is
stored once it is in the primary tier, a cache like any other tier; with lasting
acknowledgements, once a tier that keeps copies of its own has it too, so the host may
drop its own copy at once (SGLang's ``buffer_only`` host memory).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from kvtier.config import OffloadingConfig, storage_namespace
from kvtier.errors import ConfigError
from kvtier.hosts.fence import Fence
from kvtier.hosts.lasting import LastingCopies
from kvtier.hosts.requests import Requests
from kvtier.hosts.stores import StoreRoom
from kvtier.hosts.waits import Step, step_until_blocking
from kvtier.keys import OffloadKey
from kvtier.records import LookupResult, PrepareStoreOutput, ReqContext
from kvtier.region import DEFAULT_SHM_DIR
from kvtier.resources import BlockingResource
from kvtier.specs.base import OffloadingSpec
from kvtier.specs.factory import OffloadingSpecFactory
from kvtier.tiering.manager import TieringOffloadingManager

__all__ = ["IOSample", "PageStore", "Segment"]

_HIT, _HIT_PENDING = LookupResult.HIT, LookupResult.HIT_PENDING
_MISS, _RETRY = LookupResult.MISS, LookupResult.RETRY

#: ``(address, nbytes)`` of one piece of a page in the caller's memory. A page is one
#: or more segments, concatenated in order into its chunk.
Segment = tuple[int, int]

# How long a prefix found by contains_prefix keeps its request open for the load that
# normally follows, beyond twice the time the lookup was given: its queued promotions,
# its tier answers and the primary slots promoted for it (reserved for that request, so
# that nothing evicts them first). A host may give up on a prefetch without saying so
# (SGLang does after its own timeout, 1 s plus 0.25 s per 1024 tokens by default); a
# request past its lease lets go of what it holds, and a load that comes later still
# works: it looks the keys up again.
_SESSION_GRACE_S = 5.0

# Load and store samples kept for take_io_samples. SGLang takes them at every scheduler
# step when its storage metrics are on, and never when they are off: the newest this
# many are kept, so a server without metrics does not grow.
_MAX_IO_SAMPLES = 4096


@dataclass(frozen=True, slots=True)
class IOSample:
    """One load or store call: pages moved, their bytes, and its wall time."""

    pages: int
    nbytes: int
    seconds: float


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


_COUNT_NAMES = (
    "queried",
    "found",
    "loaded",
    "load_misses",
    "stored",
    "already_stored",
    "store_failures",
)


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
    verified bytes. ``request_prefix`` names the requests the tiers see
    (``<prefix>-<n>``, one per call).

    With ``lasting_acks``, :meth:`store` reports a page stored only once it has a
    lasting copy: a secondary tier that keeps copies of its own (not p2p) reported it
    stored. Until then the cascade pins the page in the primary tier, so it is never
    evicted before; a cascade that fails, times out or is dropped by back-pressure
    leaves the page unacknowledged (``False``). With no such tier the primary tier is
    the only copy, and a page is stored once it is there, as without the option: it
    stays until the primary tier, full, evicts it for newer pages.

    Raises:
        ConfigError: ``world_size`` is not 1, ``block_size`` is not the page, or
            ``lasting_acks`` with a store gate (``store_threshold`` >= 2), which skips
            pages it was asked to store.
    """

    def __init__(
        self,
        config: OffloadingConfig,
        *,
        registry: CollectorRegistry | None = None,
        shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
        request_prefix: str = "pages",
        lasting_acks: bool = False,
    ) -> None:
        if config.world_size != 1:
            raise ConfigError("world_size", "a PageStore is one rank's: expected 1")
        self.config = config
        self.page_bytes = config.kv_bytes_per_block
        spec = OffloadingSpecFactory.create_spec(config, registry=registry, shm_dir=shm_dir)
        if spec.block_size != config.tokens_per_block:
            spec.close()
            raise ConfigError(
                "block_size", f"one page is one chunk: expected {config.tokens_per_block}"
            )
        if lasting_acks and spec.settings.store_threshold >= 2:
            spec.close()
            raise ConfigError(
                "store_threshold",
                "a store gate skips pages until they were looked up often enough, so a "
                "page acknowledged as stored could be in no tier at all: remove "
                "store_threshold (or set it below 2) where the host keeps no copy of "
                "its own",
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
            spec.close()
            raise
        self.spec: OffloadingSpec = spec
        self.manager: TieringOffloadingManager = manager
        region = manager.region
        assert region is not None  # every built-in spec's manager has one
        self._rows = region.primary_view
        self._fence = Fence()
        self._requests = Requests(manager, prefix=request_prefix)
        # Another call in flight may hold slots it lets go of: a load copying out of
        # pinned slots, a store between its prepare_store and complete_store.
        self._stores = StoreRoom(manager, self._requests, in_flight=lambda: self._fence.active > 1)
        self._counts = _Counts()
        self._counts_lock = threading.Lock()
        self.lasting_acks = lasting_acks
        #: How much longer than its own time-out a store may wait for its lasting copies:
        #: the longest job time-out of the tiers that keep copies (0: none waited for).
        self.lasting_wait_s = 0.0
        self._lasting: LastingCopies | None = None
        keeping = [i for i, tier in enumerate(manager.tiers) if tier.keeps_copies]
        if lasting_acks and keeping:
            # A key stored again while it is still in the primary tier needs its answer:
            # twice the primary tier's slots covers every key it can hold.
            self._lasting = LastingCopies(keeping, remember=max(2 * manager.host.num_chunks, 1024))
            manager.host.listen_to_cascades(self._lasting)
            self.lasting_wait_s = max(manager.tiers[i].ctx.job_timeout_s for i in keeping)

    @property
    def namespace(self) -> str:
        """The storage namespace of the chunks (model, page format, shard, geometry)."""
        return storage_namespace(self.config, self.spec.settings.geometry)

    @property
    def registry(self) -> CollectorRegistry:
        """The Prometheus registry kvtier's metrics are on."""
        return self.manager.metrics.registry

    @property
    def num_chunks(self) -> int:
        """Pages the primary tier holds."""
        return self.manager.host.num_chunks

    @property
    def recompute_s_per_chunk(self) -> float | None:
        """What recomputing one page costs the host, in seconds (None: not known).

        Set it as the host measures its prefill: a page a tier would bring back more
        slowly is a miss, and no call waits longer for pages than recomputing them
        would take. Setting a value that is not positive raises ``ValueError``.
        """
        return self.manager.host.recompute_s_per_chunk

    @recompute_s_per_chunk.setter
    def recompute_s_per_chunk(self, seconds: float | None) -> None:
        self.manager.host.set_recompute_cost(seconds)

    @property
    def closed(self) -> bool:
        return self._fence.closed

    # -------------------------------------------------------------- lookups

    def contains_prefix(self, keys: Sequence[OffloadKey], timeout: float) -> int:
        """How many leading ``keys`` some tier holds; their promotions start now.

        Waits for the tiers' answers (never for the promotions), at most ``timeout``
        seconds; keys still unanswered then end the prefix. The prefix found stays with
        its request for the :meth:`load` that normally follows.
        """
        with self._fence.operation_blocking() as open_:
            if not open_:
                return 0
            self._requests.expire()
            if not keys:
                return 0
            request = self._requests.new()
            req, manager = request.req, self.manager
            found = 0

            def step() -> Step:
                nonlocal found
                with manager.lock:
                    found, asking = self._scan(keys, req)
                    manager.on_schedule_end()
                return Step.WAIT if asking else Step.DONE

            step_until_blocking(manager.host, step, deadline=time.monotonic() + timeout, req=req)
            self._count(queried=len(keys), found=found)
            if found == 0:
                self._requests.end(req.req_id)
                return 0
            self._requests.keep(request, keys[:found], 2 * timeout + _SESSION_GRACE_S)
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
        with self._fence.operation_blocking() as open_:
            if not open_:
                return done
            started = time.monotonic()
            request = self._requests.resume(keys[0]) or self._requests.new()
            req, manager, rows = request.req, self.manager, self._rows
            whole = True

            def step() -> Step:
                nonlocal whole
                with manager.lock:
                    ready, waiting, whole = self._ready(keys, done, req, whole)
                    manager.on_schedule_end()
                if ready:
                    try:
                        for index, slot in ready:
                            _copy_out(rows[slot], pages[index])
                            done[index] = True
                    finally:
                        manager.complete_load([keys[index] for index, _ in ready], req)
                return Step.WAIT if waiting else Step.DONE

            try:
                step_until_blocking(manager.host, step, deadline=started + timeout, req=req)
            finally:
                self._requests.done_with(request, keys)
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
        once and run on; the call does not wait for them, except with
        ``lasting_acks``: then a key counts as stored only once a tier that keeps copies
        reported it stored, and the call waits for that.

        Waits at most ``timeout`` seconds in all, for room in the primary tier (loads
        and cascades in flight hold slots) and for lasting copies; keys that found no
        room, or whose lasting copy has not been reported by then, are ``False``. The
        caller's memory is read only during the call.
        """
        count = len(keys)
        self._check_pages(keys, pages)
        if count == 0:
            return []
        with self._fence.operation_blocking() as open_:
            if not open_:
                return [False] * count
            started = time.monotonic()
            request = self._requests.new()
            rows = self._rows

            def copy(out: PrepareStoreOutput, part: range) -> None:
                position = {keys[i]: i for i in part}
                for key, slot in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                    _copy_in(pages[position[key]], rows[int(slot)])

            try:
                stored = self._stores.store_blocking(
                    keys, request.req, copy, deadline=started + timeout
                )
            finally:
                self._requests.end(request.req_id)
            done = [index < stored.keys for index in range(count)]
            if self._lasting is not None and stored.keys:
                done[: stored.keys] = self._await_lasting(keys[: stored.keys], started + timeout)
            moved = stored.written
            self._count(
                stored=moved,
                already_stored=stored.keys - moved,
                store_failures=count - sum(done),
                store_sample=IOSample(moved, moved * self.page_bytes, time.monotonic() - started),
            )
            return done

    def _await_lasting(self, keys: Sequence[OffloadKey], deadline: float) -> list[bool]:
        """Wait until each of ``keys`` (in the primary tier) has a lasting copy or has no
        cascade to a tier that keeps copies on its way any more; which have one."""
        lasting, manager = self._lasting, self.manager
        assert lasting is not None

        def step() -> Step:
            with manager.lock:
                manager.on_schedule_end()
                return Step.WAIT if lasting.undecided(keys) else Step.DONE

        step_until_blocking(manager.host, step, deadline=deadline)
        with manager.lock:
            return [lasting.has_copy(key) for key in keys]

    # --------------------------------------------------------------- helpers

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
        ``store_failures`` (pages :meth:`store` answered ``False`` for: no room, or
        with ``lasting_acks`` no lasting copy reported in time)."""
        with self._counts_lock:
            record = self._counts
            return {name: getattr(record, name) for name in _COUNT_NAMES}

    def take_io_samples(self) -> tuple[list[IOSample], list[IOSample]]:
        """The (loads, stores) that moved pages since the last call."""
        with self._counts_lock:
            record = self._counts
            loads, stores = list(record.load_samples), list(record.store_samples)
            record.load_samples.clear()
            record.store_samples.clear()
        return loads, stores

    def reset(self) -> None:
        """Empty the primary tier; the secondary tiers keep their chunks, and their
        back-pressure starts afresh.

        Waits for the calls in flight (each ends by its deadline) and for the tier work
        in flight; calls made meanwhile wait.
        """
        self._empty(tiers=False)

    def clear(self) -> list[str]:
        """Empty the primary tier, then ask every secondary tier to drop its chunks;
        the labels of the tiers that kept some. Waits as :meth:`reset` does."""
        return self._empty(tiers=True)

    def _empty(self, *, tiers: bool) -> list[str]:
        with self._fence.fenced_blocking() as open_:
            if not open_:
                return []
            self._requests.end_all()
            self.manager.reset_cache()
            return self.manager.clear_tiers() if tiers else []

    def close(self) -> None:
        """Let the calls in flight end, then drain and close the tiers and the region.

        Idempotent; later calls answer as misses.
        """
        with self._fence.fenced_blocking(closing=True) as open_:
            if not open_:
                return
            try:
                self._requests.end_all()
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
