"""The scheduler-facing orchestrator of the primary and secondary tiers.

Every scheduler-facing method is synchronous and never blocks: it changes in-memory
state and hands I/O to the tier event loop (:mod:`~kvtier.tiering.dispatch`). Tier
coroutines never touch this state; their outcomes come back through a completion queue
that the manager drains at its poll points (``lookup``, ``prepare_load``,
``prepare_store``, ``on_schedule_end`` and the async helpers), so the state has one
writer at a time. Who holds which primary slot is the slot ledger's record
(:mod:`~kvtier.tiering.ledger`). README "How it fits together" follows a key through
lookup, promotion, pin and load, and through store and cascade, in the order this code
runs them.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence

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
from kvtier.resources import AsyncResource, aclose_all
from kvtier.tiering.admission import Deadlines, PromotionCosts
from kvtier.tiering.completions import OutcomeServer
from kvtier.tiering.diagnostics import Diagnostics
from kvtier.tiering.dispatch import Dispatcher
from kvtier.tiering.gate import LookupCounter
from kvtier.tiering.host import HostAccess
from kvtier.tiering.jobs import JobTable
from kvtier.tiering.ledger import Holder, SlotLedger
from kvtier.tiering.lifecycle import Lifecycle
from kvtier.tiering.loop import LoopThread, TierLoop
from kvtier.tiering.options import TierOptions
from kvtier.tiering.pins import PinService
from kvtier.tiering.promotions import Promotions
from kvtier.tiering.reporting import Reporting
from kvtier.tiering.requests import RequestTable
from kvtier.tiering.runner import start_in_order
from kvtier.tiering.state import TierState
from kvtier.tiers.base import SecondaryTier

__all__ = ["TierOptions", "TieringOffloadingManager"]

_QUERIES = Names.CHUNK_QUERIES
_HITS = Names.CHUNK_HITS
_HIT, _HIT_PENDING = LookupResult.HIT, LookupResult.HIT_PENDING
_MISS, _RETRY = LookupResult.MISS, LookupResult.RETRY


class TieringOffloadingManager(AsyncResource):
    """Keeps track of what every tier holds and moves chunks between them.

    Its methods are the scheduler protocol (DESIGN section 4); what hosts need beyond
    it is :attr:`host`, counts and samples for operators :attr:`diagnostics`.

    Without secondary tiers it is the CPU spec's manager and needs no event loop; with
    tiers, they run on ``loop``: the async host's own (``HostLoop``) or a loop thread
    (``LoopThread``). The manager closes the tiers, ``region`` and ``loop`` it is given.
    A host calling it from several threads holds :attr:`lock` around each call.
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
        recompute_s_per_chunk: float | None = None,
        max_pending_s: float | None = None,
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
        self._completions = OutcomeServer(self.lock, self._loop, self._poll).queue
        self._pending = self._completions.pending
        post = self._completions.post
        self._tiers = TierState.build(tiers, options, post)
        self._jobs = JobTable(
            primary,
            self._ledger,
            region.chunk_bytes if region is not None else 0,
            [state.counts for state in self._tiers],
            [state.backpressure for state in self._tiers],
        )
        pins: PinService | None = None
        if view is not None:
            pins = PinService(self._ledger, view, post)
            for state in self._tiers:
                if state.tier.ctx.primary is not None:
                    state.tier.ctx.primary.bind(pins.for_tier(state.label))
        runners = [state.runner for state in self._tiers]
        self._life = Lifecycle(self._loop, lambda: start_in_order(runners), self._close_tiers)
        self._report = Reporting(
            self.metrics, primary, self._ledger, self._tiers, self._jobs.in_flight
        )
        self._counts = self._report.counts
        self._costs = PromotionCosts(len(tiers), recompute_s_per_chunk)
        self._deadlines = Deadlines(max_pending_s)
        self._promotions = Promotions(
            primary,
            self._jobs,
            self._counts,
            [opt.runner.max_promotion_chunks for opt in options],
            self._costs,
            [state.lookups for state in self._tiers],
            [state.counts for state in self._tiers],
            self._deadlines,
            [state.label for state in self._tiers],
        )
        self._dispatch = Dispatcher(
            self._loop,
            self._tiers,
            self._jobs,
            self._promotions,
            self._ledger,
            self._requests,
            self._completions,
            pins,
            self._finish_request,
            lambda: self._life.closed,
            self._costs,
            self._deadlines,
        )
        self.host = HostAccess(
            self.lock,
            self._poll,
            self._lookup,
            self._ledger,
            primary,
            self._completions,
            self._step_and_check,
            self._promotions,
            self._costs,
            self._deadlines,
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

    # -------------------------------------------------------------- lookups

    def lookup(self, key: OffloadKey, req: ReqContext) -> LookupResult:
        """Where ``key`` stands: HIT, HIT_PENDING, MISS or RETRY."""
        with self.lock:
            if self._pending:
                self._dispatch.drain()
            return self._lookup(key, req.req_id, None, req.load_tiers)

    def _lookup(
        self,
        key: OffloadKey,
        req_id: str,
        protected: Collection[OffloadKey] | None,
        load_tiers: frozenset[str] | None = None,
    ) -> LookupResult:
        gate = self._gate
        if gate is not None:
            gate.count(key)
        counters = self._report.primary_counts.counters
        counters[_QUERIES] += 1
        refs = self.primary.ref_count(key)
        if refs is not None:
            counters[_HITS] += 1
            if refs >= 0:
                return _HIT
            # Being written: by a store, or promoted (for this request or another).
            self._promotions.allow_wait(key, req_id)
            return _MISS if self._deadlines.expired(req_id) else _HIT_PENDING
        if not self._tiers or self._deadlines.expired(req_id):
            return _MISS
        result, evicted = self._promotions.resolve(key, req_id, protected, load_tiers)
        if evicted:
            self._evicted(evicted)
        return result

    # ---------------------------------------------------------------- loads

    def prepare_load(self, keys: Sequence[OffloadKey], req: ReqContext) -> LoadStoreSpec:
        """Pin ``keys`` (all HIT) for a primary -> GPU load; the spec gives their slots."""
        with self.lock:
            if self._pending:
                self._dispatch.drain()
            return LoadStoreSpec(chunk_ids=self._ledger.pin_for_request(keys, req.req_id))

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
                self._dispatch.drain()
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
                self._dispatch.cascade(done, req.req_id)
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
            self._promotions.forget_sources(req_id)
            self._deadlines.forget(req_id)
            released = self._ledger.release_all(Holder.reserved(req_id))
            released += self._ledger.release_all(Holder.request(req_id))
            if self._requests.finish(req_id):
                self._finish_request(req_id)
            if released:  # a store waiting for room may now evict them
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
                self._dispatch.drain()
            self._dispatch.launch_step()
            self._report.flush_if_due()

    def take_events(self) -> list[OffloadingEvent]:
        """Store and removal events since the last call: primary first, then each tier."""
        with self.lock:
            events = self.primary.take_events()
            for state in self._tiers:
                events.extend(state.tier.take_events())
            return events

    def has_pending_work(self) -> bool:
        """Whether a job or lookup is queued or in flight, or a timed-out job still runs."""
        with self.lock:
            return self._dispatch.busy() or bool(self._jobs.late)

    # ------------------------------------------------------------ completions

    def _poll(self) -> None:
        if self._pending:
            self._dispatch.drain()

    # ---------------------------------------------------------- async helpers

    async def wait_for_completions(self, since: int | None = None) -> None:
        """Resolve once a job, lookup or store finished: after ``since`` (read from
        ``host.completion_mark`` before the host checked what it waits for), or after
        this call; at once if an outcome waits to be applied."""
        await self.host.wait_for_completions(since)

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
                self._dispatch.drain()
            self._dispatch.launch_step()
            return self.has_pending_work() if include_late else self._dispatch.busy()

    # -------------------------------------------------------------- resetting

    def reset_cache(self, *, hold_busy_slots: bool = False) -> None:
        """Wait for the jobs in flight (none is aborted), then clear the primary tier;
        secondary tiers keep their data. Blocks: an async host awaits :meth:`areset_cache`.

        Slots that late I/O of a timed-out job may touch stay out of use until it stops;
        with ``hold_busy_slots``, so do those host copies were writing or reading, until
        :meth:`on_reset_flushed` (vLLM drops its copies' results at a reset).
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
            self._deadlines.clear()

    def clear_tiers(self) -> list[str]:
        """Ask every secondary tier to drop the chunks it holds, once no job or lookup
        is in flight; the labels of those that kept some (a tier that cannot clear,
        failed to, or ran past its job timeout). The primary tier is left alone
        (:meth:`reset_cache` empties it). Blocks: an async host awaits
        :meth:`aclear_tiers`."""
        return self._life.block_on(self.aclear_tiers)

    async def aclear_tiers(self) -> list[str]:
        """:meth:`clear_tiers` for an async host."""
        await self.host.settle(include_tier_pins=False, include_late=False)
        kept = [state.label for state in self._tiers if not await state.runner.clear()]
        with self.lock:
            for state in self._tiers:
                state.lookups.clear_answers()
        return kept

    def on_reset_flushed(self) -> None:
        """The host's copies in flight at the last reset have ended: reuse their slots."""
        with self.lock:
            self._ledger.release_host_copies()
            self._completions.notify()

    # -------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """vLLM's name for ``close()`` (DESIGN section 4), and the same call."""
        self.close()

    async def aclose(self) -> None:
        """Drain and close the tiers, release the region and the loop. Idempotent.

        ``close()`` is the same for a caller that may block: it waits for the jobs too.
        """
        await self._life.aclose()

    async def _close_tiers(self) -> None:
        """On the tier loop, once: what was queued goes, what is in flight ends."""
        with self.lock:
            self._promotions.drop_all()
        await self._life.wait_started()
        await aclose_all("manager", [state.runner for state in reversed(self._tiers)])
        with self.lock:
            if self._pending:
                self._dispatch.drain()
            self._report.flush()
        self.metrics.pull_from(None)
        if self._region is not None:
            await aclose_all("manager", [self._region])

    def _flush_for_collection(self) -> None:
        """A collection begins, on any thread: flush what this step counted so far."""
        with self.lock:
            self._report.flush()
