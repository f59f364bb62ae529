"""The scheduler-facing orchestrator of the primary and secondary tiers.

Every scheduler-facing method is synchronous and never blocks: it changes in-memory
state and hands I/O to the tier event loop. Tier coroutines never touch this state;
their outcomes come back through a completion queue that the manager drains at its
poll points (``lookup``, ``prepare_load``, ``prepare_store``, ``on_schedule_end`` and
the async helpers), so the state has one writer at a time.

Data flow:

- *Cascade*: ``complete_store`` makes chunks readable in the primary tier and, for
  every secondary tier whose back-pressure admits it, pins them and submits one store
  job; the pins go when that tier is done.
- *Promotion*: a ``lookup`` that misses the primary tier asks the secondary tiers in
  order; the first hit allocates a primary slot at once (so a key is promoted once)
  and queues the key; ``on_schedule_end`` submits one load job per (tier, request).
- *Async lookups*: a tier that cannot answer from memory answers RETRY; the keys it
  was asked during the step go to it as one batch at ``on_schedule_end``, and the
  answers are kept for the requests that asked until they finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvtier.keys import OffloadKey
from kvtier.metrics import MetricsRecorder, Names
from kvtier.primary import PRIMARY_LABEL, PrimaryTier
from kvtier.records import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
    ScheduleEndContext,
)
from kvtier.region import SharedOffloadRegion
from kvtier.tiering.backpressure import Backpressure, BackpressureSettings
from kvtier.tiering.loop import TierLoop
from kvtier.tiering.runner import (
    JobOutcome,
    JobReleased,
    LookupOutcome,
    RunnerSettings,
    TierRunner,
)
from kvtier.tiers.base import PinRequest, SecondaryTier, TransferJob, UnpinRequest

__all__ = ["TierOptions", "TieringOffloadingManager"]

logger = logging.getLogger(__name__)

# How soon the tier loop retries applying tier outcomes when the host holds the lock:
# the host's own calls drain them anyway; this bounds the wait of an idle host.
_SERVE_RETRY_S = 0.001

_N = TypeVar("_N", int, float)

_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING
_MISS = LookupResult.MISS
_RETRY = LookupResult.RETRY


@dataclass(frozen=True)
class TierOptions:
    """How the framework runs one tier."""

    runner: RunnerSettings = field(default_factory=RunnerSettings)
    #: None: back-pressure is off for this tier.
    backpressure: BackpressureSettings | None = None


class LookupCounter:
    """Counts lookups per key for the ``store_threshold`` gate, in bounded memory.

    Only the ``max_tracked`` most recently looked-up keys are remembered: a key that
    falls out starts counting again, which errs on the side of not storing.
    """

    def __init__(self, threshold: int, max_tracked: int) -> None:
        self.threshold = threshold
        self.max_tracked = max_tracked
        self._counts: OrderedDict[OffloadKey, int] = OrderedDict()

    def count(self, key: OffloadKey) -> None:
        counts = self._counts
        if key in counts:
            counts.move_to_end(key)
            counts[key] += 1
        else:
            if len(counts) >= self.max_tracked:
                counts.popitem(last=False)
            counts[key] = 1

    def admitted(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        counts, threshold = self._counts, self.threshold
        return [key for key in keys if counts.get(key, 0) >= threshold]


@dataclass(slots=True)
class _RequestState:
    pending_stores: int = 0
    finished: bool = False


@dataclass(slots=True)
class _Promotion:
    keys: list[OffloadKey] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    since: float = 0.0


@dataclass(slots=True)
class _Job:
    tier: int
    job: TransferJob
    since: float
    quarantined: list[int] = field(default_factory=list)


class _TierState:
    """The manager's view of one secondary tier (touched by the manager only)."""

    def __init__(self, index: int, tier: SecondaryTier, options: TierOptions) -> None:
        self.index = index
        self.tier = tier
        self.label = tier.ctx.tier_name
        self.runner: TierRunner  # set by the manager, which owns the completion queue
        self.backpressure = (
            Backpressure(options.backpressure) if options.backpressure is not None else None
        )
        #: Resolved answers, per request, per key.
        self.answers: dict[str, dict[OffloadKey, bool]] = {}
        #: Keys queued or in flight for an async lookup -> the requests waiting.
        self.asking: dict[OffloadKey, set[str]] = {}
        self.asked_at: dict[OffloadKey, float] = {}
        self.queued: list[OffloadKey] = []
        self.lookups_in_flight = 0
        self.promotions: dict[str, _Promotion] = {}
        self.active_promotions = 0
        self.active_cascades = 0
        self.write_chunks = 0
        self.read_chunks = 0
        self.stats = _TierStats()
        self.integrity_reported = 0

    def answer(self, key: OffloadKey, req_id: str) -> bool | None:
        per_request = self.answers.get(req_id)
        if per_request is not None:
            known = per_request.get(key)
            if known is not None:
                return known
        waiting = self.asking.get(key)
        if waiting is not None:
            waiting.add(req_id)
            return None
        started = time.perf_counter()
        quick = self.tier.contains(key)
        if quick is not None:
            stats = self.stats
            stats.sync_delays.append(time.perf_counter() - started)
            stats.queries += 1
            stats.hits += quick
            self.remember(req_id, key, quick)
            return quick
        self.asking[key] = {req_id}
        self.asked_at[key] = started
        self.queued.append(key)
        return None

    def remember(self, req_id: str, key: OffloadKey, present: bool) -> None:
        per_request = self.answers.get(req_id)
        if per_request is None:
            per_request = self.answers[req_id] = {}
        per_request[key] = present

    def forget_hits(self, keys: Sequence[OffloadKey], failed_for: str) -> None:
        """A load of ``keys`` for request ``failed_for`` failed.

        Other requests ask the tier again instead of trusting an old hit; the request
        whose load failed takes them as misses, so that a tier which keeps claiming a
        chunk it cannot deliver never holds a request in a loop of promotions.
        """
        lost = set(keys)
        for per_request in self.answers.values():
            for key in lost.intersection(per_request):
                del per_request[key]
        for key in lost:
            self.remember(failed_for, key, False)

    def forget_request(self, req_id: str) -> None:
        self.answers.pop(req_id, None)
        for waiting in self.asking.values():
            waiting.discard(req_id)

    @property
    def busy(self) -> bool:
        return bool(self.queued or self.promotions or self.lookups_in_flight)


@dataclass(slots=True)
class _TierStats:
    queries: int = 0
    hits: int = 0
    sync_delays: list[float] = field(default_factory=list)
    async_delays: list[float] = field(default_factory=list)
    read_bytes: int = 0
    read_time: float = 0.0
    write_bytes: int = 0
    write_time: float = 0.0
    promotion_failures: int = 0
    cascade_failures: int = 0
    promotion_latencies: list[float] = field(default_factory=list)


class _Signal:
    """Wakes whoever waits for a completion: tasks on an event loop, or blocked threads."""

    def __init__(self) -> None:
        self.seq = 0
        self._cond = threading.Condition()
        self._futures: list[asyncio.Future[None]] = []

    def notify(self) -> None:
        with self._cond:
            self.seq += 1
            self._cond.notify_all()
            futures, self._futures = self._futures, []
        for future in futures:
            loop = future.get_loop()
            if _running_loop() is loop:
                _resolve(future)
            else:
                with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                    loop.call_soon_threadsafe(_resolve, future)

    async def wait(self, seq: int) -> None:
        """Resolve once :meth:`notify` runs after ``seq`` was read."""
        future = asyncio.get_running_loop().create_future()
        with self._cond:
            if self.seq != seq:
                return
            self._futures.append(future)
        await future

    def wait_blocking(self, seq: int, timeout: float | None = None) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.seq != seq, timeout)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class TieringOffloadingManager:
    """Keeps track of what every tier holds and moves chunks between them.

    With no secondary tiers this is the CPU spec's manager. With tiers, their coroutines
    run on the event loop that was running when the manager was built (an async host's
    own loop), or on a loop thread the manager owns (a synchronous host). A host that
    calls the manager from more than one thread holds :attr:`lock` around each call.
    """

    def __init__(
        self,
        primary: PrimaryTier,
        *,
        tiers: Sequence[SecondaryTier] = (),
        tier_options: Sequence[TierOptions] | None = None,
        region: SharedOffloadRegion | None = None,
        metrics: MetricsRecorder | None = None,
        store_threshold: int = 0,
        max_tracked_lookups: int = 64_000,
    ) -> None:
        self.primary = primary
        self.lock = threading.RLock()
        self.metrics = metrics if metrics is not None else MetricsRecorder({})
        self._region = region
        self._records = primary.records
        self._gate = (
            LookupCounter(store_threshold, max_tracked_lookups) if store_threshold >= 2 else None
        )
        self._requests: dict[str, _RequestState] = {}
        self._closed = False
        self._chunk_bytes = region.chunk_bytes if region is not None else 0
        options = list(tier_options) if tier_options is not None else [TierOptions()] * len(tiers)
        if len(options) != len(tiers):
            raise ValueError("tier_options must hold one entry per tier")
        self._tiers = [
            _TierState(i, tier, opt)
            for i, (tier, opt) in enumerate(zip(tiers, options, strict=True))
        ]
        self._completions: deque[object] = deque()
        self._signal = _Signal()
        self._jobs: dict[int, _Job] = {}
        self._next_job_id = 0
        self._loop: TierLoop | None = None
        self._start_task: asyncio.Future[None] | None = None
        self._started = not self._tiers
        self._serve_scheduled = False
        #: Pins tiers hold through PrimaryAccess, by key (released by UnpinRequest).
        self._tier_pins: dict[OffloadKey, int] = {}
        if self._tiers:
            self._loop = TierLoop()
            for state in self._tiers:
                state.runner = TierRunner(
                    state.index, state.tier, options[state.index].runner, self._post
                )
                if state.tier.ctx.primary is not None:
                    state.tier.ctx.primary.bind(self._post)
        # Counters flushed to Prometheus once per step (see _flush_metrics).
        self._primary_queries = 0
        self._primary_hits = 0
        self._stores_skipped = 0
        self._evictions = 0
        self._allocation_failures = 0
        self._allocation_sizes: list[int] = []

    @property
    def region(self) -> SharedOffloadRegion | None:
        return self._region

    @property
    def tiers(self) -> list[SecondaryTier]:
        return [state.tier for state in self._tiers]

    @property
    def tier_labels(self) -> list[str]:
        return [state.label for state in self._tiers]

    @property
    def owns_loop(self) -> bool:
        """Whether the tiers run on a loop thread of the manager's own (a sync host)."""
        return self._loop is not None and self._loop.owned

    def readable_prefix(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading ``keys`` are readable in the primary tier right now."""
        with self.lock:
            if self._completions:
                self._drain()
            records = self._records
            for count, key in enumerate(keys):
                record = records.get(key)
                if record is None or record.ref_cnt < 0:
                    return count
            return len(keys)

    # ---------------------------------------------------------------- start

    async def start(self) -> None:
        """Start the tiers in order. Idempotent; every caller awaits the same start.

        If a tier fails to start, the tiers already started are closed, the region is
        released and the error propagates: the manager cannot be used.
        """
        if self._started:
            return
        loop = self._require_loop()
        if self._start_task is None:
            future = asyncio.run_coroutine_threadsafe(self._start_tiers(), loop.loop)
            self._start_task = asyncio.wrap_future(future)
        await asyncio.shield(self._start_task)

    def start_blocking(self, timeout: float | None = None) -> None:
        """:meth:`start` for a synchronous host (not from the tier loop's thread)."""
        if self._started:
            return
        loop = self._require_loop()
        loop.run(self.start(), timeout)

    async def _start_tiers(self) -> None:
        started: list[_TierState] = []
        try:
            for state in self._tiers:
                await state.runner.start()
                started.append(state)
        except BaseException:
            logger.error(
                "tier %s failed to start; closing the tiers started before it",
                self._tiers[len(started)].label,
            )
            for state in self._tiers:
                state.runner.abandon()
            for state in reversed(started):
                await _close_tier(state, drain=False)
            self._closed = True
            if self._region is not None:
                self._region.close()
            raise
        self._started = True

    # -------------------------------------------------------------- lookups

    def lookup(self, key: OffloadKey, req: ReqContext) -> LookupResult:
        """Where ``key`` stands: HIT, HIT_PENDING, MISS or RETRY."""
        with self.lock:
            if self._completions:
                self._drain()
            gate = self._gate
            if gate is not None:
                gate.count(key)
            self._primary_queries += 1
            record = self._records.get(key)
            if record is not None:
                self._primary_hits += 1
                return _HIT if record.ref_cnt >= 0 else _HIT_PENDING
            if not self._tiers:
                return _MISS
            return self._lookup_secondaries(key, req.req_id)

    def _lookup_secondaries(self, key: OffloadKey, req_id: str) -> LookupResult:
        retry = False
        for state in self._tiers:
            present = state.answer(key, req_id)
            if present is None:
                retry = True
            elif present:
                return self._begin_promotion(state, key, req_id)
        return _RETRY if retry else _MISS

    def _begin_promotion(self, state: _TierState, key: OffloadKey, req_id: str) -> LookupResult:
        out = self.primary.prepare_write([key])
        if out is None or not out.keys_to_store:
            self._allocation_failures += 1
            return _MISS
        if out.evicted_keys:
            self._evictions += len(out.evicted_keys)
            self._primary_removed(out.evicted_keys)
        promotion = state.promotions.get(req_id)
        if promotion is None:
            promotion = state.promotions[req_id] = _Promotion(since=time.perf_counter())
        promotion.keys.append(key)
        promotion.slots.append(out.store_spec.chunk_ids[0])
        return _HIT_PENDING

    # ---------------------------------------------------------------- loads

    def prepare_load(self, keys: Sequence[OffloadKey], req: ReqContext) -> LoadStoreSpec:
        """Pin ``keys`` (all HIT) for a primary -> GPU load; the spec gives their slots."""
        with self.lock:
            if self._completions:
                self._drain()
            return self.primary.prepare_load(keys)

    def touch(self, keys: Sequence[OffloadKey], req: ReqContext) -> None:
        """Record a use of ``keys`` (first = head of the prefix) in every tier."""
        with self.lock:
            self.primary.touch(keys)
            for state in self._tiers:
                state.tier.touch(keys)

    def complete_load(self, keys: Sequence[OffloadKey], req: ReqContext) -> None:
        """Unpin ``keys`` after the GPU read them."""
        with self.lock:
            self.primary.complete_load(keys)
            # A store waiting for room may now evict them.
            self._signal.notify()

    # --------------------------------------------------------------- stores

    def prepare_store(
        self, keys: Sequence[OffloadKey], req: ReqContext
    ) -> PrepareStoreOutput | None:
        """Allocate primary slots for the keys not stored yet; None if there is no room."""
        with self.lock:
            if self._completions:
                self._drain()
            gate = self._gate
            if gate is not None:
                admitted = gate.admitted(keys)
                self._stores_skipped += len(keys) - len(admitted)
                keys = admitted
            output = self.primary.prepare_store(keys)
            if output is None:
                return None
            if output.keys_to_store:
                self._allocation_sizes.append(len(output.keys_to_store))
                if output.evicted_keys:
                    self._evictions += len(output.evicted_keys)
                    self._primary_removed(output.evicted_keys)
                state = self._requests.get(req.req_id)
                if state is None:
                    state = self._requests[req.req_id] = _RequestState()
                state.pending_stores += 1
            return output

    def complete_store(
        self, keys: Sequence[OffloadKey], req: ReqContext, success: bool = True
    ) -> None:
        """Finish a GPU -> primary store; on success cascade the keys to every tier."""
        with self.lock:
            done = self.primary.complete_store(keys, success)
            if done and self._tiers and not self._closed:
                for state in self._tiers:
                    self._cascade(state, done, req.req_id)
            request = self._requests.get(req.req_id)
            if request is not None and request.pending_stores > 0:
                request.pending_stores -= 1
                if request.finished and request.pending_stores == 0:
                    self._finish_request(req.req_id)
            # Lookups that saw these keys pending may be waiting for them.
            self._signal.notify()

    def _cascade(self, state: _TierState, keys: list[OffloadKey], req_id: str) -> None:
        if state.backpressure is not None and not state.backpressure.admit(len(keys)):
            return
        spec = self.primary.prepare_read(keys)
        job = TransferJob(self._new_job_id(), tuple(keys), tuple(spec.chunk_ids), False, req_id)
        now = time.perf_counter()
        self._jobs[job.job_id] = _Job(state.index, job, now)
        state.active_cascades += 1
        state.read_chunks += len(keys)
        assert self._loop is not None
        self._loop.call(state.runner.launch_job, job, now)

    # ------------------------------------------------------------- requests

    def on_new_request(self, req: ReqContext) -> None:
        """A request entered the scheduler."""

    def on_request_finished(self, req: ReqContext) -> None:
        """A request left the scheduler; tiers hear of it once its stores completed."""
        with self.lock:
            request = self._requests.get(req.req_id)
            if request is not None and request.pending_stores > 0:
                request.finished = True
                return
            self._finish_request(req.req_id)

    def _finish_request(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        for state in self._tiers:
            state.forget_request(req_id)
            state.tier.on_request_finished(req_id)

    # ----------------------------------------------------------------- steps

    def on_schedule_end(self, ctx: ScheduleEndContext | None = None) -> None:
        """End of a step: drain, send the step's lookups and promotions, flush metrics."""
        with self.lock:
            if self._completions:
                self._drain()
            self._launch_step()
            self._flush_metrics()

    def _launch_step(self) -> None:
        if not self._tiers or self._closed:
            return
        launches: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        now = time.perf_counter()
        for state in self._tiers:
            if state.queued:
                keys = tuple(state.queued)
                state.queued = []
                state.lookups_in_flight += 1
                launches.append((state.runner.launch_lookup, (keys,)))
            for req_id, promotion in state.promotions.items():
                job = TransferJob(
                    self._new_job_id(), tuple(promotion.keys), tuple(promotion.slots), True, req_id
                )
                self._jobs[job.job_id] = _Job(state.index, job, promotion.since)
                state.active_promotions += 1
                state.write_chunks += len(job.keys)
                launches.append((state.runner.launch_job, (job, now)))
            state.promotions.clear()
        if launches:
            assert self._loop is not None
            self._loop.call(_launch_all, launches)

    def take_events(self) -> list[OffloadingEvent]:
        """Store and removal events since the last call: primary first, then each tier."""
        with self.lock:
            events = self.primary.take_events()
            for state in self._tiers:
                events.extend(state.tier.take_events())
            return events

    def has_pending_work(self) -> bool:
        """Whether any job or lookup is queued or in flight."""
        with self.lock:
            return bool(self._jobs) or any(state.busy for state in self._tiers)

    # ------------------------------------------------------------ completions

    def _post(self, outcome: object) -> None:
        """Queue an outcome or request from the tier side (any thread)."""
        self._completions.append(outcome)
        self._signal.notify()
        if not self._serve_scheduled and self._loop is not None:
            self._serve_scheduled = True
            with contextlib.suppress(RuntimeError):  # the loop is closed: shutdown drains
                self._loop.call(self._serve)

    def _serve(self) -> None:
        """On the tier loop: apply queued outcomes now rather than at the next poll point.

        Tiers waiting for pins, and hosts waiting for completions, then need no scheduler
        step. If the host holds the lock right now, try again in a millisecond.
        """
        assert self._loop is not None
        if not self.lock.acquire(blocking=False):
            self._loop.loop.call_later(_SERVE_RETRY_S, self._serve)
            return
        try:
            self._serve_scheduled = False
            if self._completions:
                self._drain()
        finally:
            self.lock.release()
        self._signal.notify()

    def _drain(self) -> None:
        completions = self._completions
        while completions:
            outcome = completions.popleft()
            if isinstance(outcome, JobOutcome):
                self._on_job(outcome)
            elif isinstance(outcome, LookupOutcome):
                self._on_lookup(outcome)
            elif isinstance(outcome, JobReleased):
                self._on_released(outcome)
            elif isinstance(outcome, PinRequest):
                self._on_pin(outcome)
            elif isinstance(outcome, UnpinRequest):
                self._on_unpin(outcome)

    def _on_pin(self, request: PinRequest) -> None:
        assert self._region is not None
        view = self._region.primary_view
        rows: dict[OffloadKey, memoryview] = {}
        for key in request.keys:
            record = self._records.get(key)
            if record is None or record.ref_cnt < 0 or key in rows:
                continue
            self.primary.prepare_read([key])
            self._tier_pins[key] = self._tier_pins.get(key, 0) + 1
            rows[key] = view[record.slot]
        future = request.future
        loop = future.get_loop()
        if _running_loop() is loop:
            self._deliver_pins(future, rows)
        else:
            loop.call_soon_threadsafe(self._deliver_pins, future, rows)

    def _deliver_pins(
        self,
        future: asyncio.Future[dict[OffloadKey, memoryview]],
        rows: dict[OffloadKey, memoryview],
    ) -> None:
        if future.done():  # the tier gave up waiting: release what it would have held
            self._post(UnpinRequest(tuple(rows)))
        else:
            future.set_result(rows)

    def _on_unpin(self, request: UnpinRequest) -> None:
        pins = self._tier_pins
        for key in request.keys:
            held = pins.get(key, 0)
            if held == 0:
                continue  # released by a reset already
            if held == 1:
                del pins[key]
            else:
                pins[key] = held - 1
            self.primary.complete_read([key])

    def _on_lookup(self, outcome: LookupOutcome) -> None:
        state = self._tiers[outcome.runner]
        state.lookups_in_flight -= 1
        answers = outcome.answers or (False,) * len(outcome.keys)
        now = time.perf_counter()
        stats = state.stats
        for key, present in zip(outcome.keys, answers, strict=True):
            waiting = state.asking.pop(key, ())
            asked = state.asked_at.pop(key, None)
            if asked is not None:
                stats.async_delays.append(now - asked)
            stats.queries += 1
            stats.hits += present
            for req_id in waiting:
                state.remember(req_id, key, present)

    def _on_job(self, outcome: JobOutcome) -> None:
        entry = self._jobs.get(outcome.job.job_id)
        if entry is None:
            return
        state = self._tiers[outcome.runner]
        job, result = outcome.job, outcome.result
        stats = state.stats
        if job.is_promotion:
            if outcome.released and result.success and result.successful_keys is None:
                loaded, failed = list(job.keys), []
            else:
                succeeded = set(result.successful_keys or ()) if outcome.released else set()
                loaded = [key for key in job.keys if key in succeeded]
                failed = [key for key in job.keys if key not in succeeded]
            if outcome.released:
                del self._jobs[job.job_id]
                state.active_promotions -= 1
                state.write_chunks -= len(job.keys)
                self.primary.complete_write(loaded, True)
                self.primary.complete_write(failed, False)
            else:
                entry.quarantined = self.primary.detach(job.keys)
            if failed:
                state.forget_hits(failed, job.req_id)
            if not result.success:
                stats.promotion_failures += 1
            if loaded:
                stats.read_bytes += _or(result.transfer_bytes, len(loaded) * self._chunk_bytes)
                stats.read_time += _or(result.transfer_time, outcome.elapsed)
                stats.promotion_latencies.append(time.perf_counter() - entry.since)
        else:
            if outcome.released:
                del self._jobs[job.job_id]
                state.active_cascades -= 1
                state.read_chunks -= len(job.keys)
                self.primary.complete_read(job.keys)
            nbytes = _or(result.transfer_bytes, len(job.keys) * self._chunk_bytes)
            if result.success:
                stats.write_bytes += nbytes
                stats.write_time += _or(result.transfer_time, outcome.elapsed)
            else:
                stats.cascade_failures += 1
            if state.backpressure is not None:
                state.backpressure.record(outcome.elapsed, nbytes, failed=not result.success)

    def _on_released(self, released: JobReleased) -> None:
        entry = self._jobs.pop(released.job.job_id, None)
        if entry is None:
            return
        state = self._tiers[released.runner]
        job = released.job
        if job.is_promotion:
            state.active_promotions -= 1
            state.write_chunks -= len(job.keys)
            self.primary.free_slots(entry.quarantined)
        else:
            state.active_cascades -= 1
            state.read_chunks -= len(job.keys)
            self.primary.complete_read(job.keys)

    # ---------------------------------------------------------- async helpers

    async def wait_for_completions(self) -> None:
        """Resolve once a job, lookup or store finished (at once if one already has)."""
        seq = self._signal.seq
        if self._completions:
            return
        await self._signal.wait(seq)

    def wait_for_completions_blocking(self, timeout: float | None = None) -> None:
        """:meth:`wait_for_completions` for a synchronous host's thread."""
        seq = self._signal.seq
        if self._completions:
            return
        self._signal.wait_blocking(seq, timeout)

    async def drain(self) -> None:
        """Send what the step queued, then resolve once nothing is in flight."""
        await self._settle(include_pins=False)

    async def _settle(self, *, include_pins: bool) -> None:
        while True:
            seq = self._signal.seq
            if not self._step_and_check(include_pins):
                return
            await self._signal.wait(seq)

    def _settle_blocking(self, *, include_pins: bool) -> None:
        while True:
            seq = self._signal.seq
            if not self._step_and_check(include_pins):
                return
            self._signal.wait_blocking(seq)

    def _step_and_check(self, include_pins: bool) -> bool:
        """Apply outcomes and send queued work; whether anything is still in flight."""
        with self.lock:
            if self._completions:
                self._drain()
            self._launch_step()
            return self.has_pending_work() or (include_pins and bool(self._tier_pins))

    # -------------------------------------------------------------- resetting

    def reset_cache(self) -> None:
        """Wait for every job in flight (none is aborted), then clear the primary tier.

        Secondary tiers keep their data. An async host on the tier loop uses
        :meth:`areset_cache` instead.
        """
        with self.lock:
            self._cancel_queued()
        if self._tiers and not self._closed:
            if self._require_loop().in_loop_thread():
                with self.lock:
                    if self.has_pending_work() or self._tier_pins:
                        raise RuntimeError(
                            "reset_cache would block the event loop: "
                            "use await manager.areset_cache()"
                        )
            else:
                self._settle_blocking(include_pins=True)
        with self.lock:
            self._reset()

    async def areset_cache(self) -> None:
        """:meth:`reset_cache` for an async host."""
        with self.lock:
            self._cancel_queued()
        await self._settle(include_pins=True)
        with self.lock:
            self._reset()

    def _cancel_queued(self) -> None:
        """Drop lookups and promotions not yet sent: their slots were never written."""
        for state in self._tiers:
            for promotion in state.promotions.values():
                self.primary.complete_write(promotion.keys, False)
            state.promotions.clear()
            for key in state.queued:
                state.asking.pop(key, None)
                state.asked_at.pop(key, None)
            state.queued = []

    def _primary_removed(self, keys: Sequence[OffloadKey]) -> None:
        for state in self._tiers:
            state.tier.on_primary_removed(keys)

    def _reset(self) -> None:
        readable = [key for key, record in self._records.items() if record.ref_cnt >= 0]
        if readable:
            self._primary_removed(readable)
        self._tier_pins.clear()
        self.primary.reset()
        for req_id in list(self._requests):
            if self._requests[req_id].finished:
                self._finish_request(req_id)
        self._requests.clear()
        for state in self._tiers:
            state.answers.clear()

    # -------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Drain and close the tiers, release the region. Idempotent.

        Blocks until in-flight jobs finish; an async host whose loop runs the tiers
        awaits :meth:`aclose` instead.
        """
        if self._closed:
            self._stop_loop()
            return
        if self._tiers and self._started:
            self._require_loop().run(self._close_tiers())
        self._finish_close()

    async def aclose(self) -> None:
        """:meth:`shutdown` without blocking the event loop."""
        if self._closed:
            self._stop_loop()
            return
        if self._tiers and self._started:
            loop = self._require_loop()
            if loop.in_loop_thread():
                await self._close_tiers()
            else:
                await asyncio.to_thread(loop.run, self._close_tiers())
        self._finish_close()

    async def _close_tiers(self) -> None:
        """On the tier loop: finish every job, then close the tiers, last first."""
        with self.lock:
            self._cancel_queued()
        for state in reversed(self._tiers):
            await _close_tier(state)

    def _finish_close(self) -> None:
        with self.lock:
            if self._completions:
                self._drain()
            self._closed = True
            self._flush_metrics()
        if self._region is not None:
            self._region.close()
        self._stop_loop()

    def _stop_loop(self) -> None:
        if self._loop is not None and self._loop.owned:
            self._loop.stop()

    # --------------------------------------------------------------- helpers

    def _new_job_id(self) -> int:
        self._next_job_id += 1
        return self._next_job_id

    def _require_loop(self) -> TierLoop:
        if self._loop is None:
            raise RuntimeError("this manager has no secondary tiers and no event loop")
        return self._loop

    # --------------------------------------------------------------- metrics

    def _flush_metrics(self) -> None:
        metrics = self.metrics
        primary = self.primary
        metrics.set(Names.CPU_CACHE_USAGE_PERC, primary.num_busy / primary.num_chunks)
        if self._allocation_sizes:
            metrics.observe_many(Names.CPU_ALLOCATION_SIZE, self._allocation_sizes)
            self._allocation_sizes = []
        for name, attr in (
            (Names.CPU_EVICTIONS, "_evictions"),
            (Names.STORES_SKIPPED, "_stores_skipped"),
            (Names.PROMOTION_ALLOCATION_FAILURES, "_allocation_failures"),
        ):
            value = getattr(self, attr)
            if value:
                metrics.inc(name, value)
                setattr(self, attr, 0)
        if not self._tiers:
            return
        primary_label = (PRIMARY_LABEL,)
        metrics.inc(Names.CHUNK_QUERIES, self._primary_queries, primary_label)
        metrics.inc(Names.CHUNK_HITS, self._primary_hits, primary_label)
        self._primary_queries = self._primary_hits = 0
        for state in self._tiers:
            self._flush_tier(state)

    def _flush_tier(self, state: _TierState) -> None:
        metrics = self.metrics
        label = (state.label,)
        stats, state.stats = state.stats, _TierStats()
        metrics.inc(Names.CHUNK_QUERIES, stats.queries, label)
        metrics.inc(Names.CHUNK_HITS, stats.hits, label)
        metrics.observe_many(Names.LOOKUP_SYNC_DELAY, stats.sync_delays, label)
        metrics.observe_many(Names.LOOKUP_ASYNC_DELAY, stats.async_delays, label)
        metrics.inc(Names.READ_BYTES, stats.read_bytes, label)
        metrics.inc(Names.READ_TIME, stats.read_time, label)
        metrics.inc(Names.WRITE_BYTES, stats.write_bytes, label)
        metrics.inc(Names.WRITE_TIME, stats.write_time, label)
        metrics.inc(Names.PROMOTION_JOB_FAILURES, stats.promotion_failures, label)
        metrics.inc(Names.CASCADE_JOB_FAILURES, stats.cascade_failures, label)
        metrics.observe_many(Names.PROMOTION_LATENCY, stats.promotion_latencies, label)
        num_chunks = self.primary.num_chunks
        metrics.set(Names.PRIMARY_WRITE_USAGE_PERC, state.write_chunks / num_chunks, label)
        metrics.set(Names.PRIMARY_READ_USAGE_PERC, state.read_chunks / num_chunks, label)
        metrics.set(Names.ACTIVE_PROMOTION_JOBS, state.active_promotions, label)
        metrics.set(Names.ACTIVE_CASCADE_JOBS, state.active_cascades, label)
        integrity = state.tier.ctx.counters.integrity_failures
        metrics.inc(Names.INTEGRITY_FAILURES, integrity - state.integrity_reported, label)
        state.integrity_reported = integrity
        if state.backpressure is not None:
            metrics.set(Names.BACKPRESSURE_STORE_LATENCY_EMA, state.backpressure.ema, label)
            stores, blocks = state.backpressure.take_dropped()
            metrics.inc(Names.BACKPRESSURE_STORES_DROPPED, stores, label)
            metrics.inc(Names.BACKPRESSURE_BLOCKS_DROPPED, blocks, label)

    # ---------------------------------------------------------- introspection

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """Cumulative counts per tier label, for benchmarks and diagnostics."""
        with self.lock:
            metrics = self.metrics
            result: dict[str, dict[str, float]] = {}
            for label in [PRIMARY_LABEL, *self.tier_labels]:
                labels = {"tier": label}
                result[label] = {
                    name: metrics.sample(f"{metric}_total", labels) or 0.0
                    for name, metric in (
                        ("queries", Names.CHUNK_QUERIES),
                        ("hits", Names.CHUNK_HITS),
                        ("bytes_read", Names.READ_BYTES),
                        ("bytes_written", Names.WRITE_BYTES),
                        ("read_time", Names.READ_TIME),
                        ("write_time", Names.WRITE_TIME),
                        ("integrity_failures", Names.INTEGRITY_FAILURES),
                        ("stores_dropped", Names.BACKPRESSURE_STORES_DROPPED),
                        ("promotion_failures", Names.PROMOTION_JOB_FAILURES),
                        ("cascade_failures", Names.CASCADE_JOB_FAILURES),
                    )
                }
            return result


def _or(reported: _N | None, measured: _N) -> _N:
    """A tier's own figure when it gave one (0 included), else the framework's."""
    return measured if reported is None else reported


async def _close_tier(state: _TierState, *, drain: bool = True) -> None:
    """Drain and close one tier; a failure is logged so that the others still close."""
    try:
        if drain:
            await state.runner.close()
        else:
            await state.tier.aclose()
    except Exception:
        logger.exception("tier %s failed to close", state.label)


def _launch_all(launches: list[tuple[Callable[..., None], tuple[Any, ...]]]) -> None:
    for launch, args in launches:
        launch(*args)
