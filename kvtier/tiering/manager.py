"""The scheduler-facing orchestrator of the primary and secondary tiers.

Every scheduler-facing method is synchronous and never blocks: it changes in-memory
state and hands I/O to the tier event loop. Tier coroutines never touch this state;
their outcomes come back through a completion queue that the manager drains at its
poll points (``lookup``, ``prepare_load``, ``prepare_store``, ``on_schedule_end`` and
the async helpers), so the state has one writer at a time.

A key's trip, in the order the code runs it:

1. *Lookup* (:meth:`lookup`): the primary tier answers first; on a miss each secondary
   tier is asked in order (:mod:`~kvtier.tiering.lookups`: from memory, or queued for
   one batch per step). The first tier that holds the key gets a primary slot
   allocated for it at once (:mod:`~kvtier.tiering.promotions`), so a key is promoted
   once, and the answer is HIT_PENDING.
2. *Promotion*: :meth:`on_schedule_end` sends the step's lookups and starts one load
   job per (tier, request) while the tier's chunk budget allows
   (:mod:`~kvtier.tiering.jobs`, run by :mod:`~kvtier.tiering.runner`). When the job
   ends its keys are readable and *reserved* for the request in the slot ledger
   (:mod:`~kvtier.tiering.ledger`), so no other request evicts them first.
3. *Pin*: :meth:`prepare_load` pins the keys for the request; reserved keys are
   transferred to it, not pinned twice.
4. *Load*: the host copies the slots to the GPU and :meth:`complete_load` releases
   the request's pins.

And the other way: :meth:`prepare_store` allocates slots, the host copies into them,
:meth:`complete_store` makes them readable and *cascades* them: one store job per
secondary tier that back-pressure admits, each pinning the slots until its tier is
done. A job that outlives its timeout is failed at once; its slots stay with the
ledger until its I/O has stopped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Sequence
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
from kvtier.tiering.diagnostics import Diagnostics
from kvtier.tiering.gate import LookupCounter
from kvtier.tiering.host import HostAccess
from kvtier.tiering.jobs import JobTable
from kvtier.tiering.ledger import Holder, SlotLedger
from kvtier.tiering.lifecycle import Lifecycle
from kvtier.tiering.loop import LoopThread, TierLoop
from kvtier.tiering.outcomes import (
    JobOutcome,
    JobReleased,
    LookupOutcome,
    Outcome,
    PinRequest,
    SettleSlots,
    UnpinRequest,
)
from kvtier.tiering.pins import PinService
from kvtier.tiering.promotions import Promotions
from kvtier.tiering.reporting import Reporting
from kvtier.tiering.requests import RequestTable
from kvtier.tiering.runner import RunnerSettings, TierRunner, start_in_order
from kvtier.tiering.state import TierState
from kvtier.tiers.base import SecondaryTier, TransferJob

__all__ = ["TierOptions", "TieringOffloadingManager"]

_QUERIES = Names.CHUNK_QUERIES
_HITS = Names.CHUNK_HITS
_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING
_MISS = LookupResult.MISS
_RETRY = LookupResult.RETRY

# How often the manager looks again whether late I/O still touches the slots kept for
# it. Only slots of jobs that timed out wait for this; a slot's reuse waits at most
# this long after its last user let go.
_SETTLE_INTERVAL_S = 0.05


@dataclass(frozen=True)
class TierOptions:
    """How the framework runs one tier."""

    runner: RunnerSettings = field(default_factory=RunnerSettings)
    #: None: back-pressure is off for this tier.
    backpressure: BackpressureSettings | None = None


class TieringOffloadingManager(AsyncResource):
    """Keeps track of what every tier holds and moves chunks between them.

    Its methods are the scheduler protocol (DESIGN section 4). What an async host needs
    beyond it is :attr:`host`; counts and samples for benchmarks and operators are
    :attr:`diagnostics`.

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
        view = region.primary_view if region is not None else None
        self._ledger = SlotLedger(primary, view)
        self._requests = RequestTable()
        self._completions = OutcomeServer(self.lock, self._loop, self._drain).queue
        self._pending = self._completions.pending
        post = self._completions.post
        self._tiers = [
            TierState(
                TierRunner(i, tier, opt.runner, post),
                Backpressure(opt.backpressure) if opt.backpressure is not None else None,
            )
            for i, (tier, opt) in enumerate(zip(tiers, options, strict=True))
        ]
        self._jobs = JobTable(
            primary,
            self._ledger,
            region.chunk_bytes if region is not None else 0,
            [state.counts for state in self._tiers],
            [state.backpressure for state in self._tiers],
        )
        self._pin_service: PinService | None = None
        if view is not None:
            self._pin_service = PinService(self._ledger, view, post)
            for state in self._tiers:
                if state.tier.ctx.primary is not None:
                    state.tier.ctx.primary.bind(self._pin_service.for_tier(state.label))
        self._settling = False
        self._life = Lifecycle(self._loop, self._start_tiers, self._close_tiers)
        self._report = Reporting(
            self.metrics, primary, self._ledger, self._tiers, self._jobs.in_flight
        )
        self._counts = self._report.counts
        self._promotions = Promotions(
            primary,
            self._jobs,
            self._counts,
            [opt.runner.max_promotion_chunks for opt in options],
        )
        self.host = HostAccess(
            self.lock,
            self._poll,
            self._lookup,
            self._ledger,
            primary,
            self._completions,
            self._step_and_check,
            has_tiers=bool(self._tiers),
        )
        self.diagnostics = Diagnostics(self.lock, self._report, self._ledger, self._tiers)
        # A scrape of an idle engine sees current counts, not those of its last step.
        self.metrics.pull_from(self._flush_for_collection)

    @property
    def region(self) -> SharedOffloadRegion | None:
        return self._region

    @property
    def tiers(self) -> list[SecondaryTier]:
        return [state.tier for state in self._tiers]

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
        for index, state in enumerate(self._tiers):
            present = state.lookups.answer(key, req_id)
            if present is None:
                retry = True
            elif present:
                # The first tier holding the key promotes it; no slot left: a miss.
                evicted = self._promotions.begin(index, key, req_id, protected)
                if evicted is None:
                    return _MISS
                self._evicted(evicted)
                return _HIT_PENDING
        return _RETRY if retry else _MISS

    # ---------------------------------------------------------------- loads

    def prepare_load(self, keys: Sequence[OffloadKey], req: ReqContext) -> LoadStoreSpec:
        """Pin ``keys`` (all HIT) for a primary -> GPU load; the spec gives their slots."""
        with self.lock:
            if self._pending:
                self._drain()
            return LoadStoreSpec(chunk_ids=self._pin(keys, req.req_id))

    def _pin(self, keys: Sequence[OffloadKey], req_id: str) -> list[int]:
        """Pin readable ``keys`` for a request, taking over those reserved for it."""
        ledger, holder = self._ledger, Holder.request(req_id)
        reserved = Holder.reserved(req_id)
        taken = ledger.transfer(keys, reserved, holder)
        if not taken:
            return ledger.pin(keys, holder)
        rest = list(keys)
        for key in taken:
            rest.remove(key)
        ledger.pin(rest, holder)
        slot_of = self.primary.slot_of
        return [slot for key in keys if (slot := slot_of(key)) is not None]

    def touch(self, keys: Sequence[OffloadKey], req: ReqContext) -> None:
        """Record a use of ``keys`` (first = head of the prefix) in every tier."""
        with self.lock:
            self.primary.touch(keys)
            for state in self._tiers:
                state.tier.touch(keys)

    def complete_load(self, keys: Sequence[OffloadKey], req: ReqContext) -> None:
        """Release the request's pins on ``keys`` after the GPU read them."""
        with self.lock:
            self._ledger.release(keys, Holder.request(req.req_id))
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
                now = time.perf_counter()
                self._launch(
                    [
                        (index, job)
                        for index in range(len(self._tiers))
                        if (job := self._jobs.cascade(index, done, req.req_id, now)) is not None
                    ]
                )
            if self._requests.ended(req.req_id):
                self._finish_request(req.req_id)
            # Lookups that saw these keys pending may be waiting for them.
            self._completions.notify()

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
        """A request left the scheduler: its promotions not yet sent and the slots it
        holds go now; tiers hear of it once its stores and promotions ended."""
        with self.lock:
            req_id = req.req_id
            self._promotions.drop_request(req_id)
            self._ledger.release_all(Holder.reserved(req_id))
            self._ledger.release_all(Holder.request(req_id))
            if self._requests.finish(req_id):
                self._finish_request(req_id)
            self._completions.notify()

    def _finish_request(self, req_id: str) -> None:
        for state in self._tiers:
            state.lookups.forget_request(req_id)
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
        now = time.perf_counter()
        lookups: list[tuple[int, tuple[OffloadKey, ...]]] = []
        jobs: list[tuple[int, TransferJob]] = []
        for index, state in enumerate(self._tiers):
            batch = state.lookups.take_queued()
            if batch is not None:
                lookups.append((index, batch))
            jobs.extend((index, job) for job in self._promotions.end_step(index, now))
        self._launch(jobs, lookups)

    def _launch(
        self,
        jobs: list[tuple[int, TransferJob]],
        lookups: Sequence[tuple[int, tuple[OffloadKey, ...]]] = (),
    ) -> None:
        """Hand jobs and lookup batches to the tier loop: the one way work gets there."""
        if not jobs and not lookups:
            return
        for _, job in jobs:
            if job.is_promotion:
                self._requests.started(job.req_id)
        assert self._loop is not None
        runners = [state.runner for state in self._tiers]
        self._loop.call(_launch_all, runners, jobs, lookups, time.perf_counter())

    def take_events(self) -> list[OffloadingEvent]:
        """Store and removal events since the last call: primary first, then each tier."""
        with self.lock:
            events = self.primary.take_events()
            for state in self._tiers:
                events.extend(state.tier.take_events())
            return events

    def has_pending_work(self) -> bool:
        """Whether any job or lookup is queued or in flight, or a job that timed out
        still runs (its slots come back when it ends)."""
        with self.lock:
            return self._busy() or bool(self._jobs.late)

    def _busy(self) -> bool:
        """Whether any job or lookup is queued or in flight."""
        with self.lock:
            return bool(self._jobs) or any(
                state.lookups.busy or self._promotions.busy(index)
                for index, state in enumerate(self._tiers)
            )

    # ------------------------------------------------------------ completions

    def _poll(self) -> None:
        if self._pending:
            self._drain()

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
                ended = self._jobs.finished(outcome)
                if ended is None:
                    return False
                if ended.failed:
                    self._tiers[ended.tier].lookups.forget_hits(ended.failed, ended.req_id)
                if ended.loaded and self._requests.live(ended.req_id):
                    # Kept for the request that asked until it loads them or finishes.
                    self._ledger.pin(ended.loaded, Holder.reserved(ended.req_id))
                if self._requests.ended(ended.req_id):
                    self._finish_request(ended.req_id)
                return True
            case LookupOutcome():
                self._tiers[outcome.runner].lookups.lookup_done(outcome)
            case JobReleased():
                self._jobs.late_ended(outcome.job.job_id)
                counters = self._tiers[outcome.runner].counts.counters
                counters[Names.LATE_COMPLETIONS] += 1
                if self._ledger.io_ended(outcome.job.job_id):
                    self._settle_later()
            case SettleSlots():
                self._settling = False
                if self._ledger.settle():
                    self._settle_later()
            case PinRequest():
                assert self._pin_service is not None
                self._pin_service.serve_pin(outcome)
            case UnpinRequest():
                assert self._pin_service is not None
                self._pin_service.serve_unpin(outcome)
        return False

    def _settle_later(self) -> None:
        """Look again soon whether late I/O still touches the slots kept for it."""
        loop = self._loop
        if self._settling or loop is None:
            return
        self._settling = True
        post = self._completions.post
        loop.call(loop.loop.call_later, _SETTLE_INTERVAL_S, post, SettleSlots())

    # ---------------------------------------------------------- async helpers

    async def wait_for_completions(self) -> None:
        """Resolve once a job, lookup or store finished (at once if one already has)."""
        await self.host.wait_for_completions()

    def wait_for_completions_blocking(self, timeout: float | None = None) -> None:
        """:meth:`wait_for_completions` for a synchronous host's thread."""
        self.host.wait_for_completions_blocking(timeout)

    async def drain(self) -> None:
        """Send what the step queued, resolve once nothing is in flight, flush the metrics."""
        await self.host.drain()
        with self.lock:
            self._report.flush()

    def _step_and_check(self, include_late: bool) -> bool:
        """Apply outcomes and send queued work; whether anything is still in flight
        (with ``include_late``, jobs that timed out and still run too)."""
        with self.lock:
            if self._pending:
                self._drain()
            self._launch_step()
            return self.has_pending_work() if include_late else self._busy()

    # -------------------------------------------------------------- resetting

    def reset_cache(self, *, hold_busy_slots: bool = False) -> None:
        """Wait for every job in flight (none is aborted), then clear the primary tier.

        Secondary tiers keep their data. Slots that late I/O of a timed-out job may
        still touch stay out of use until it stops. With ``hold_busy_slots`` the slots
        that host copies were still writing or reading (prepared and not completed) are
        not reused until :meth:`on_reset_flushed`: a host that drops its copies'
        results at a reset, as vLLM does, says that way when its copies have stopped.
        Blocks the calling thread: an async host awaits :meth:`areset_cache` instead.
        """
        self._life.block_on(lambda: self.areset_cache(hold_busy_slots=hold_busy_slots))

    async def areset_cache(self, *, hold_busy_slots: bool = False) -> None:
        """:meth:`reset_cache` for an async host."""
        with self.lock:
            self._promotions.drop_all()
            for state in self._tiers:
                state.lookups.drop_queued()
        await self.host.settle(include_tier_pins=True, include_late=False)
        with self.lock:
            readable = self.primary.readable_keys()
            if readable:
                self._primary_removed(readable)
            self._ledger.reset(hold_host_copies=hold_busy_slots)
            for req_id in self._requests.reset():
                self._finish_request(req_id)
            for state in self._tiers:
                state.lookups.clear_answers()

    def on_reset_flushed(self) -> None:
        """The host's copies in flight at the last reset have ended: reuse their slots."""
        with self.lock:
            self._ledger.release_host_copies()
            self._completions.notify()

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

    def _flush_for_collection(self) -> None:
        """A metrics collection begins, on any thread: flush what this step counted so far.

        Only the flush runs under the lock (a few dozen Prometheus updates plus the
        step's samples), so a scrape holds the scheduler up for no longer than a step's
        end does.
        """
        with self.lock:
            self._report.flush()


def _launch_all(
    runners: Sequence[TierRunner],
    jobs: Sequence[tuple[int, TransferJob]],
    lookups: Sequence[tuple[int, tuple[OffloadKey, ...]]],
    submitted: float,
) -> None:
    for index, batch in lookups:
        runners[index].launch_lookup(batch)
    for index, job in jobs:
        runners[index].launch_job(job, submitted)
