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

import logging
import threading
import time
from collections.abc import Collection, Container, Sequence
from dataclasses import dataclass, field

from kvtier.keys import OffloadKey
from kvtier.metrics import MetricsRecorder, Names
from kvtier.primary import PrimaryTier
from kvtier.records import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
    ScheduleEndContext,
)
from kvtier.region import SharedOffloadRegion
from kvtier.resources import AsyncResource
from kvtier.tiering.backpressure import Backpressure, BackpressureSettings
from kvtier.tiering.completions import OutcomeServer
from kvtier.tiering.gate import LookupCounter
from kvtier.tiering.jobs import JobTable
from kvtier.tiering.lifecycle import Lifecycle
from kvtier.tiering.lookups import PrefixLookup, TierState
from kvtier.tiering.loop import LoopThread, TierLoop
from kvtier.tiering.outcomes import (
    JobOutcome,
    JobReleased,
    LookupOutcome,
    Outcome,
    PinRequest,
    UnpinRequest,
)
from kvtier.tiering.pins import PinService
from kvtier.tiering.promotions import Launch, Promotions
from kvtier.tiering.reporting import Reporting
from kvtier.tiering.requests import RequestTable
from kvtier.tiering.runner import RunnerSettings, TierRunner, start_in_order
from kvtier.tiers.base import SecondaryTier

__all__ = ["TierOptions", "TieringOffloadingManager"]

logger = logging.getLogger(__name__)

_QUERIES = Names.CHUNK_QUERIES
_HITS = Names.CHUNK_HITS
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


class TieringOffloadingManager(AsyncResource):
    """Keeps track of what every tier holds and moves chunks between them.

    With no secondary tiers this is the CPU spec's manager and needs no event loop.
    With tiers, their coroutines run on ``loop``: the async host's own
    (:class:`~kvtier.tiering.loop.HostLoop`) or a loop thread
    (:class:`~kvtier.tiering.loop.LoopThread`), chosen by whoever builds the manager.
    The manager owns what it is given: it closes the tiers, ``region`` and ``loop``
    when it closes. A host that calls it from more than one thread holds :attr:`lock`
    around each call.
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
        loop: TierLoop | None = None,
    ) -> None:
        options = list(tier_options) if tier_options is not None else [TierOptions()] * len(tiers)
        if len(options) != len(tiers):
            raise ValueError("tier_options must hold one entry per tier")
        if tiers and loop is None:
            raise ValueError(
                "a manager with secondary tiers needs an event loop: loop=HostLoop() on "
                "an async host's loop, or loop=LoopThread() for a synchronous host"
            )
        self.primary = primary
        self.lock = threading.RLock()
        self.metrics = metrics if metrics is not None else MetricsRecorder({})
        self._region = region
        self._loop = loop if tiers else None
        if loop is not None and not tiers:
            loop.close()  # owned, and nothing will run on it
        self._gate = (
            LookupCounter(store_threshold, max_tracked_lookups) if store_threshold >= 2 else None
        )
        self._requests = RequestTable()
        self._completions = OutcomeServer(self.lock, self._loop, self._drain).queue
        self._pending = self._completions.pending
        self._jobs = JobTable(primary, region.chunk_bytes if region is not None else 0)
        self._tiers = [
            TierState(
                TierRunner(i, tier, opt.runner, self._completions.post),
                Backpressure(opt.backpressure) if opt.backpressure is not None else None,
            )
            for i, (tier, opt) in enumerate(zip(tiers, options, strict=True))
        ]
        self._pins: PinService | None = None
        if region is not None:
            self._pins = PinService(primary, region.primary_view, self._completions.post)
            for tier in tiers:
                if tier.ctx.primary is not None:
                    tier.ctx.primary.bind(self._pins)
        self._life = Lifecycle(self._loop, self._start_tiers, self._close_tiers)
        self._report = Reporting(self.metrics, primary, self._tiers)
        self._counts = self._report.counts
        self._promotions = Promotions(
            primary, self._jobs, self._requests, self._counts, self._evicted, self._tiers
        )
        # A scrape of an idle engine sees current counts, not those of its last step.
        self.metrics.pull_from(self._flush_for_collection)

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
    def loop(self) -> TierLoop | None:
        """Where the tiers run; None without secondary tiers."""
        return self._loop

    @property
    def owns_loop(self) -> bool:
        """Whether the tiers run on a loop thread of the manager's own (a sync host)."""
        return isinstance(self._loop, LoopThread)

    @property
    def closed(self) -> bool:
        return self._life.closed

    # ---------------------------------------------------------------- start

    async def start(self) -> None:
        """Start the tiers in order. Idempotent; every caller awaits the same start.

        If a tier fails to start, the tiers already started are closed and the error
        propagates: the manager cannot be used, and :meth:`aclose` releases the rest.
        """
        await self._life.start()

    def start_blocking(self, timeout: float | None = None) -> None:
        """:meth:`start` for a synchronous host (not from the tier loop's thread)."""
        self._life.start_blocking(timeout)

    async def _start_tiers(self) -> None:
        await start_in_order([state.runner for state in self._tiers])

    # -------------------------------------------------------------- lookups

    def lookup(self, key: OffloadKey, req: ReqContext) -> LookupResult:
        """Where ``key`` stands: HIT, HIT_PENDING, MISS or RETRY."""
        with self.lock:
            if self._pending:
                self._drain()
            return self._lookup(key, req.req_id, None)

    def lookup_prefix(
        self,
        keys: Sequence[OffloadKey],
        req: ReqContext,
        held: Container[OffloadKey] = (),
    ) -> PrefixLookup:
        """Look a whole prefix up in one call, pinning what is readable.

        Walks ``keys`` in order, skipping those in ``held`` (pinned by an earlier
        call), up to the first key no tier holds. Keys readable now are pinned for
        the request (release them with :meth:`complete_load`); keys on their way
        (being written, promoted or asked) make the answer pending. Promotions
        started here never evict a key of ``keys``.
        """
        with self.lock:
            if self._pending:
                self._drain()
            req_id = req.req_id
            prefix = set(keys) if self._tiers else None
            readable: list[OffloadKey] = []
            pending = False
            for key in keys:
                if key in held:
                    continue
                result = self._lookup(key, req_id, prefix)
                if result is _HIT:
                    readable.append(key)
                elif result is _MISS:
                    break
                else:
                    pending = True
            slots = self._pin(readable, req_id) if readable else []
            return PrefixLookup(dict(zip(readable, slots, strict=True)), pending)

    def readable_prefix(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading ``keys`` are readable in the primary tier right now."""
        with self.lock:
            if self._pending:
                self._drain()
            return self.primary.readable_prefix(keys)

    def _lookup(
        self, key: OffloadKey, req_id: str, protected: Collection[OffloadKey] | None
    ) -> LookupResult:
        gate = self._gate
        if gate is not None:
            gate.count(key)
        counters = self._report.primary_counts.counters
        counters[_QUERIES] += 1
        refs = self.primary.ref_count(key)
        if refs is not None:
            counters[_HITS] += 1
            return _HIT if refs >= 0 else _HIT_PENDING
        retry = False
        for state in self._tiers:
            present = state.answer(key, req_id)
            if present is None:
                retry = True
            elif present:
                # The first tier holding the key promotes it; no slot left: a miss.
                if self._promotions.begin(state, key, req_id, protected):
                    return _HIT_PENDING
                return _MISS
        return _RETRY if retry else _MISS

    # ---------------------------------------------------------------- loads

    def prepare_load(self, keys: Sequence[OffloadKey], req: ReqContext) -> LoadStoreSpec:
        """Pin ``keys`` (all HIT) for a primary -> GPU load; the spec gives their slots."""
        with self.lock:
            if self._pending:
                self._drain()
            return LoadStoreSpec(chunk_ids=self._pin(keys, req.req_id))

    def _pin(self, keys: Sequence[OffloadKey], req_id: str) -> list[int]:
        """Pin readable ``keys`` for a request, taking over pins reserved for it."""
        slots = list(self.primary.prepare_load(keys).chunk_ids)
        claimed = self._requests.claim(req_id, keys)
        if claimed:
            self.primary.complete_load(claimed)
        return slots

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
            self._completions.notify()

    # --------------------------------------------------------------- stores

    def prepare_store(
        self, keys: Sequence[OffloadKey], req: ReqContext
    ) -> PrepareStoreOutput | None:
        """Allocate primary slots for the keys not stored yet; None if there is no room."""
        with self.lock:
            if self._pending:
                self._drain()
            gate = self._gate
            if gate is not None:
                admitted = gate.admitted(keys)
                self._counts.counters[Names.STORES_SKIPPED] += len(keys) - len(admitted)
                keys = admitted
            output = self.primary.prepare_store(keys)
            if output is None:
                return None
            if output.keys_to_store:
                self._counts.samples[Names.CPU_ALLOCATION_SIZE].append(len(output.keys_to_store))
                self._evicted(output.evicted_keys)
                self._requests.started(req.req_id)
            return output

    def complete_store(
        self, keys: Sequence[OffloadKey], req: ReqContext, success: bool = True
    ) -> None:
        """Finish a GPU -> primary store; on success cascade the keys to every tier."""
        with self.lock:
            done = self.primary.complete_store(keys, success)
            if done and self._tiers and not self._life.closed:
                self._cascade(done, req.req_id)
            if self._requests.ended(req.req_id):
                self._finish_request(req.req_id)
            # Lookups that saw these keys pending may be waiting for them.
            self._completions.notify()

    def _cascade(self, keys: list[OffloadKey], req_id: str) -> None:
        assert self._loop is not None
        now = time.perf_counter()
        for state in self._tiers:
            job = self._jobs.cascade(state, keys, req_id, now)
            if job is not None:
                self._loop.call(state.runner.launch_job, job, now)

    def _evicted(self, keys: Sequence[OffloadKey]) -> None:
        if keys:
            self._counts.counters[Names.CPU_EVICTIONS] += len(keys)
            self._primary_removed(keys)

    def _primary_removed(self, keys: Sequence[OffloadKey]) -> None:
        for state in self._tiers:
            state.tier.on_primary_removed(keys)

    # ------------------------------------------------------------- requests

    def on_new_request(self, req: ReqContext) -> None:
        """A request entered the scheduler."""

    def on_request_finished(self, req: ReqContext) -> None:
        """A request left the scheduler: its promotions not yet sent and the chunks kept
        for it go now; tiers hear of it once its stores and promotions ended."""
        with self.lock:
            req_id = req.req_id
            self._promotions.drop_request(req_id)
            reserved = self._requests.take_reserved(req_id)
            if reserved:
                self.primary.complete_load(reserved)
            if self._requests.finish(req_id):
                self._finish_request(req_id)

    def _finish_request(self, req_id: str) -> None:
        for state in self._tiers:
            state.forget_request(req_id)
            state.tier.on_request_finished(req_id)

    # ----------------------------------------------------------------- steps

    def on_schedule_end(self, ctx: ScheduleEndContext | None = None) -> None:
        """End of a step: drain, send the step's lookups and promotions; flush metrics
        if the last flush is a while ago (a scrape of the registry flushes first)."""
        with self.lock:
            if self._pending:
                self._drain()
            self._launch_step()
            self._report.flush_if_due()

    def _launch_step(self) -> None:
        if not self._tiers or self._life.closed:
            return
        launches: list[Launch] = []
        now = time.perf_counter()
        for state in self._tiers:
            batch = state.take_queued()
            if batch is not None:
                launches.append((state.runner.launch_lookup, (batch,)))
            self._promotions.end_step(state, now, launches)
        self._launch(launches)

    def _launch(self, launches: list[Launch]) -> None:
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

    def _promotion_ended(self, req_id: str, promoted: list[OffloadKey]) -> None:
        # Keep what was promoted for the request that asked, until it loads or finishes.
        if promoted and self._requests.reserve(req_id, promoted):
            self.primary.prepare_read(promoted)
        if self._requests.ended(req_id):
            self._finish_request(req_id)

    def _drain(self) -> None:
        promotions_ended = False
        for outcome in self._completions.drain():
            promotions_ended |= self._apply(outcome)
        if promotions_ended and not self._life.closed:
            self._launch(self._promotions.start_waiting(time.perf_counter()))

    def _apply(self, outcome: Outcome) -> bool:
        """Apply one outcome; whether it let a promotion job of its tier go."""
        match outcome:
            case JobOutcome():
                promoted = self._jobs.finished(outcome)
                if promoted is not None:
                    self._promotion_ended(outcome.job.req_id, promoted)
                return outcome.job.is_promotion and outcome.released
            case LookupOutcome():
                self._tiers[outcome.runner].lookup_done(outcome)
            case JobReleased():
                self._jobs.released(outcome)
                return outcome.job.is_promotion
            case PinRequest():
                assert self._pins is not None
                self._pins.serve_pin(outcome)
            case UnpinRequest():
                assert self._pins is not None
                self._pins.serve_unpin(outcome)
        return False

    # ---------------------------------------------------------- async helpers

    async def wait_for_completions(self) -> None:
        """Resolve once a job, lookup or store finished (at once if one already has)."""
        await self._completions.wait_for_any()

    def wait_for_completions_blocking(self, timeout: float | None = None) -> None:
        """:meth:`wait_for_completions` for a synchronous host's thread."""
        self._completions.wait_for_any_blocking(timeout)

    async def drain(self) -> None:
        """Send what the step queued, resolve once nothing is in flight, flush the metrics."""
        await self._settle(include_pins=False)
        with self.lock:
            self._report.flush()

    async def _settle(self, *, include_pins: bool) -> None:
        while True:
            seq = self._completions.seq
            if not self._step_and_check(include_pins):
                return
            await self._completions.wait(seq)

    def _step_and_check(self, include_pins: bool) -> bool:
        """Apply outcomes and send queued work; whether anything is still in flight."""
        with self.lock:
            if self._pending:
                self._drain()
            self._launch_step()
            held = include_pins and self._pins is not None and self._pins.held
            return self.has_pending_work() or held

    # -------------------------------------------------------------- resetting

    def reset_cache(self, *, hold_busy_slots: bool = False) -> None:
        """Wait for every job in flight (none is aborted), then clear the primary tier.

        Secondary tiers keep their data. With ``hold_busy_slots`` the slots that host
        copies were still writing or reading (prepared and not completed) are not
        reused until :meth:`on_reset_flushed`: a host that drops its copies' results at
        a reset, as vLLM does, says that way when its copies have stopped. Blocks the
        calling thread: an async host awaits :meth:`areset_cache` instead.
        """
        self._life.block_on(lambda: self.areset_cache(hold_busy_slots=hold_busy_slots))

    async def areset_cache(self, *, hold_busy_slots: bool = False) -> None:
        """:meth:`reset_cache` for an async host."""
        with self.lock:
            self._promotions.drop_all()
        await self._settle(include_pins=True)
        with self.lock:
            self._reset(hold_busy_slots)

    def on_reset_flushed(self) -> None:
        """The host's copies in flight at the last reset have ended: reuse their slots."""
        with self.lock:
            self.primary.release_held()
            self._completions.notify()

    def _reset(self, hold_busy_slots: bool = False) -> None:
        readable = self.primary.readable_keys()
        if readable:
            self._primary_removed(readable)
        if self._pins is not None:
            self._pins.forget()
        self.primary.reset(hold_busy=hold_busy_slots)
        for req_id in self._requests.reset():
            self._finish_request(req_id)
        for state in self._tiers:
            state.answers.clear()

    # -------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Drain and close the tiers, release the region and the loop. Idempotent.

        Blocks until in-flight jobs finish; an async host awaits :meth:`aclose`.
        """
        self._life.close_blocking()

    async def aclose(self) -> None:
        """Drain and close the tiers, release the region and the loop. Idempotent."""
        await self._life.aclose()

    async def _close_tiers(self) -> None:
        """On the tier loop, once: what was queued goes, what is in flight ends."""
        with self.lock:
            self._promotions.drop_all()
        await self._life.wait_started()
        for state in reversed(self._tiers):
            await state.runner.aclose()
        with self.lock:
            if self._pending:
                self._drain()
            self._report.flush()
        self.metrics.pull_from(None)
        if self._region is not None:
            self._region.close()

    # --------------------------------------------------------------- metrics

    def _flush_for_collection(self) -> None:
        """A metrics collection begins, on any thread: flush what this step counted so far.

        Only the flush runs under the lock (a few dozen Prometheus updates plus the
        step's samples), so a scrape holds the scheduler up for no longer than a step's
        end does.
        """
        with self.lock:
            self._report.flush()

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """Cumulative counts per tier label, for benchmarks and diagnostics."""
        with self.lock:
            return self._report.totals()

    def promotion_latencies(self) -> dict[str, list[float]]:
        """Measured promotion job latencies in seconds, by secondary tier label.

        Each is one job's time from the lookup that found its first key in the tier
        until its chunks were readable in the primary tier. A bounded uniform sample
        (:class:`~kvtier.tiering.stats.Reservoir`): percentiles taken from it are
        measured times, not the edges of histogram buckets.
        """
        return self._measured(Names.PROMOTION_LATENCY)

    def promotion_job_times(self) -> dict[str, list[float]]:
        """Measured promotion job times in seconds, by secondary tier label.

        Each is one job's time from its start on the tier until its chunks were
        readable: :meth:`promotion_latencies` less the wait for a free job (see the
        ``max_promotion_chunks`` setting). A bounded uniform sample, as there.
        """
        return self._measured(Names.PROMOTION_JOB_TIME)

    def _measured(self, name: str) -> dict[str, list[float]]:
        with self.lock:
            return self._report.measured(name)


def _launch_all(launches: list[Launch]) -> None:
    for launch, args in launches:
        launch(*args)
