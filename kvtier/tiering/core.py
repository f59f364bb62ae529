"""The tiering core: the one context every part of the manager works in, and its decisions.

:class:`TieringCore` holds the parts (the primary tier, the slot ledger, the request
records, the tiers, the jobs in flight, the promotion queues, the completion queue) and
makes the decisions that span them: where a key stands for a request, what a store
cascades, what the end of a step sends to the tier loop, and what each outcome that
comes back does. The parts receive the core and read what they need from it; the
manager (the scheduler protocol) and :class:`~kvtier.tiering.host.HostAccess` (what
hosts need beyond it) call down to it, and nothing calls back up into either. Work
goes to the tier loop in one call per step; outcomes come back through the completion
queue and are applied here, so the state has one writer at a time. Everything here runs
under :attr:`lock`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence

from kvtier.keys import OffloadKey
from kvtier.metrics import MetricsRecorder, Names
from kvtier.primary import PrimaryTier
from kvtier.records import LookupResult
from kvtier.region import SharedOffloadRegion
from kvtier.resources import aclose_all
from kvtier.tiering.completions import (
    JobOutcome,
    JobReleased,
    LookupOutcome,
    Outcome,
    OutcomeServer,
    PinRequest,
    SettleSlots,
    TierPins,
    UnpinRequest,
)
from kvtier.tiering.jobs import JobTable
from kvtier.tiering.ledger import Holder, HolderKind, SlotLedger
from kvtier.tiering.loop import Lifecycle, TierLoop
from kvtier.tiering.promotions import PromotionCosts, Promotions
from kvtier.tiering.reporting import Reporting
from kvtier.tiering.requests import PRIMARY, RequestTable
from kvtier.tiering.runner import TierRunner, start_in_order
from kvtier.tiering.state import TierOptions, TierState
from kvtier.tiers.base import SecondaryTier, TransferJob

__all__ = ["LookupCounter", "TieringCore"]

_HIT, _HIT_PENDING = LookupResult.HIT, LookupResult.HIT_PENDING
_MISS = LookupResult.MISS
_QUERIES = Names.CHUNK_QUERIES
_HITS = Names.CHUNK_HITS

# How often the core looks again whether late I/O still touches the slots kept for it.
# Only slots of jobs that timed out wait for this; such a slot is reused at most this
# long after its last user let go.
_SETTLE_INTERVAL_S = 0.05

_Lookups = Sequence[tuple[int, tuple[OffloadKey, ...]]]


class LookupCounter:
    """The ``store_threshold`` gate: counts lookups per key, in bounded memory, so that
    a chunk is stored only once it was looked up enough times.

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


class TieringCore:
    """The parts of one manager, and the decisions that span them."""

    def __init__(
        self,
        primary: PrimaryTier,
        tiers: Sequence[SecondaryTier],
        options: Sequence[TierOptions],
        *,
        region: SharedOffloadRegion | None,
        metrics: MetricsRecorder,
        loop: TierLoop | None,
        store_threshold: int,
        max_tracked_lookups: int,
        recompute_s_per_chunk: float | None,
        max_pending_s: float | None,
    ) -> None:
        self.primary = primary
        self.lock = threading.RLock()
        self.metrics = metrics
        self.region = region
        self.loop = loop
        self.chunk_bytes = region.chunk_bytes if region is not None else 0
        self.gate = (
            LookupCounter(store_threshold, max_tracked_lookups) if store_threshold >= 2 else None
        )
        self.view = region.primary_view if region is not None else None
        self.ledger = SlotLedger(primary, self.view)
        self.requests = RequestTable(max_pending_s)
        self.completions = OutcomeServer(self.lock, loop, self.drain).queue
        #: The outcomes not applied yet (the hot paths test it directly).
        self.pending = self.completions.pending
        self.tiers = TierState.build(tiers, options, self.completions.post)
        self.jobs = JobTable(self)
        self.costs = PromotionCosts(len(tiers), recompute_s_per_chunk)
        self.promotions = Promotions(self)
        self.report = Reporting(self)
        #: The manager's own unlabelled counts.
        self.counts = self.report.counts
        if self.view is not None:
            for state in self.tiers:
                access = state.tier.ctx.primary
                if access is not None:
                    access.bind(TierPins(Holder.tier(state.label), self.completions.post))
        self.life = Lifecycle(loop, self._start_tiers, self._close_tiers)
        self._runners = [state.runner for state in self.tiers]
        self._settling = False

    # -------------------------------------------------------------- lookups

    def lookup(
        self,
        key: OffloadKey,
        req_id: str,
        protected: Collection[OffloadKey] | None,
        load_tiers: frozenset[str] | None = None,
    ) -> LookupResult:
        """Where ``key`` stands for the request: HIT, HIT_PENDING, MISS or RETRY.

        A secondary-tier hit starts its promotion; ``protected`` keys (by default, the
        keys the request found readable) are never evicted to make room for it.
        """
        gate = self.gate
        if gate is not None:
            gate.count(key)
        refs = self.primary.ref_count(key)
        requests = self.requests
        request = requests.open(req_id)
        if refs is not None and refs < 0:
            # Being written: by a store, or promoted (for this request or another). Not
            # an answer yet, so not counted: the lookup that finds it readable is.
            self.promotions.allow_wait(key, request)
            return _MISS if requests.expired(req_id) else _HIT_PENDING
        if request.counts_answer(PRIMARY, key):
            counters = self.report.primary_counts.counters
            counters[_QUERIES] += 1
            if refs is not None:
                counters[_HITS] += 1
        if refs is not None:
            if self.tiers:
                request.found.add(key)
            return _HIT
        if not self.tiers or requests.expired(req_id):
            return _MISS
        if protected is None:
            protected = request.found
        result, evicted = self.promotions.resolve(key, request, protected, load_tiers)
        if evicted:
            self.evicted(evicted)
        return result

    def admitted(self, keys: Sequence[OffloadKey]) -> Sequence[OffloadKey]:
        """The keys the ``store_threshold`` gate lets a store write (skips counted)."""
        gate = self.gate
        if gate is None:
            return keys
        admitted = gate.admitted(keys)
        self.counts.counters[Names.STORES_SKIPPED] += len(keys) - len(admitted)
        return admitted

    def evicted(self, keys: Sequence[OffloadKey]) -> None:
        if keys:
            self.counts.counters[Names.CPU_EVICTIONS] += len(keys)
            self.primary_removed(keys)

    def primary_removed(self, keys: Sequence[OffloadKey]) -> None:
        for state in self.tiers:
            state.tier.on_primary_removed(keys)

    # ------------------------------------------------------------- requests

    def finish(self, req_id: str) -> None:
        """The request finished: its promotions not yet sent and the slots it holds go
        now; its tiers hear of it once its stores and promotions ended."""
        request = self.requests.get(req_id)
        if request is not None:
            self.promotions.drop_request(request)
        self.ledger.release_request(req_id)
        if self.requests.finish(req_id):
            self._tiers_hear_finished(req_id)
        # A store waiting for room may now evict what it held, and a host waiting for
        # the call to end may go on (a notify with nobody asleep costs a counter).
        self.completions.notify()

    def expire(self, req_id: str) -> None:
        """Stop waiting for the request's pending chunks (they are misses from now on);
        its promotions not started yet free their slots."""
        request = self.requests.open(req_id)
        request.expired = True
        self.promotions.drop_request(request)

    def _tiers_hear_finished(self, req_id: str) -> None:
        for state in self.tiers:
            state.forget_request(req_id)
            state.tier.on_request_finished(req_id)

    def work_ended(self, req_id: str) -> None:
        """A store or promotion of the request ended."""
        if self.requests.ended(req_id):
            self._tiers_hear_finished(req_id)

    # ------------------------------------------------------------------ out

    def cascade(self, keys: list[OffloadKey], req_id: str) -> None:
        """One store job of readable ``keys`` per tier that back-pressure admits."""
        if not self.tiers or self.life.closed:
            return
        now = time.perf_counter()
        jobs = self.jobs
        self._launch(
            [
                (index, job)
                for index in range(len(self.tiers))
                if (job := jobs.cascade(index, keys, req_id, now)) is not None
            ]
        )

    def launch_step(self) -> None:
        """End of a step: its lookup batches and the promotion jobs that may start."""
        if not self.tiers or self.life.closed:
            return
        now = time.perf_counter()
        lookups: list[tuple[int, tuple[OffloadKey, ...]]] = []
        jobs: list[tuple[int, TransferJob]] = []
        for index, state in enumerate(self.tiers):
            batch = state.take_queued()
            if batch is not None:
                lookups.append((index, batch))
            jobs.extend((index, job) for job in self.promotions.end_step(index, now))
        self._launch(jobs, lookups)

    def _launch(self, jobs: list[tuple[int, TransferJob]], lookups: _Lookups = ()) -> None:
        """Hand jobs and lookup batches to the tier loop: the one way work gets there."""
        if not jobs and not lookups:
            return
        for _, job in jobs:
            if job.is_promotion:
                self.requests.started(job.req_id)
        assert self.loop is not None
        self.loop.call(_launch_all, self._runners, jobs, lookups, time.perf_counter())

    def busy(self) -> bool:
        """Whether any job or lookup is queued or in flight (late jobs aside)."""
        return bool(self.jobs) or any(
            state.asking or self.promotions.busy(index) for index, state in enumerate(self.tiers)
        )

    def step(self, include_late: bool) -> bool:
        """Apply outcomes and send queued work; whether anything is still in flight
        (with ``include_late``, jobs that timed out and still run too)."""
        with self.lock:
            if self.pending:
                self.drain()
            self.launch_step()
            busy = self.busy()
            return busy or bool(self.jobs.late) if include_late else busy

    # ------------------------------------------------------------------- in

    def poll(self) -> None:
        """Apply the outcomes posted so far, if any."""
        if self.pending:
            self.drain()

    def drain(self) -> None:
        """Apply every outcome posted so far; start the promotions they let go."""
        promotions_ended = False
        for outcome in self.completions.drain():
            promotions_ended |= self._apply(outcome)
        if promotions_ended and not self.life.closed:
            self._launch(self.promotions.start_waiting(time.perf_counter()))

    def _apply(self, outcome: Outcome) -> bool:
        """Apply one outcome; whether it let a promotion job of its tier go."""
        match outcome:
            case JobOutcome():
                return self._job_ended(outcome)
            case LookupOutcome():
                self.tiers[outcome.runner].lookup_done(outcome, self.requests)
            case JobReleased():
                self.jobs.late_ended(outcome.job.job_id)
                self.tiers[outcome.runner].counts.counters[Names.LATE_COMPLETIONS] += 1
                if self.ledger.io_ended(outcome.job.job_id):
                    self._settle_later()
            case SettleSlots():
                self._settling = False
                if self.ledger.settle():
                    self._settle_later()
            case PinRequest():
                self._serve_pin(outcome)
            case UnpinRequest():
                # A reset released them already if the ledger no longer has them.
                self.ledger.release_held(outcome.keys, outcome.holder)
        return False

    def _job_ended(self, outcome: JobOutcome) -> bool:
        ended = self.jobs.finished(outcome)
        if ended is None:  # a cascade
            return False
        req_id = ended.req_id
        promotions = self.promotions
        promotions.ended(ended.loaded)
        promotions.ended(ended.failed)
        self.costs.job_done(ended.tier, ended.job_time, len(ended.loaded) + len(ended.failed))
        request = self.requests.get(req_id)
        if ended.failed:
            self.tiers[ended.tier].forget_hits(ended.failed, request, self.requests)
        if ended.loaded and request is not None and not request.finished and not request.expired:
            # Kept for the request that asked until it loads them or finishes.
            self.ledger.pin(ended.loaded, Holder.reserved(req_id))
        self.work_ended(req_id)
        return True

    def _serve_pin(self, request: PinRequest) -> None:
        pinned = self.ledger.pin_readable(request.keys, request.holder)
        assert self.view is not None
        view = self.view
        rows = {key: view[slot] for key, slot in pinned.items()}
        try:
            request.future.get_loop().call_soon_threadsafe(_deliver, request, rows, self)
        except RuntimeError:  # that loop is closed: nobody is waiting for the rows
            self.ledger.release_held(list(rows), request.holder)

    def _settle_later(self) -> None:
        """Look again soon whether late I/O still touches the slots kept for it."""
        loop = self.loop
        if self._settling or loop is None:
            return
        self._settling = True
        post = self.completions.post
        loop.call(loop.loop.call_later, _SETTLE_INTERVAL_S, post, SettleSlots())

    # -------------------------------------------------------------- waiting

    async def settle(self, *, include_tier_pins: bool, include_late: bool) -> None:
        """Resolve once no job or lookup is in flight; with ``include_tier_pins`` once
        no tier pins a slot either, with ``include_late`` once no job that timed out
        still runs."""
        completions = self.completions
        while True:
            mark = completions.seq
            busy = self.step(include_late)
            if include_tier_pins and not busy:
                with self.lock:
                    busy = self.ledger.any_pins(HolderKind.TIER)
            if not busy:
                return
            await completions.wait(mark)

    # ------------------------------------------------------ reset and clear

    async def reset(self, *, hold_busy_slots: bool) -> None:
        """Wait for the jobs in flight, then empty the primary tier and start every
        tier's back-pressure afresh (see the manager's ``reset_cache``)."""
        with self.lock:
            self.promotions.drop_all()
            for state in self.tiers:
                state.drop_queued()
        await self.settle(include_tier_pins=True, include_late=False)
        with self.lock:
            readable = self.primary.readable_keys()
            if readable:
                self.primary_removed(readable)
            self.ledger.reset(hold_host_copies=hold_busy_slots)
            for state in self.tiers:
                if state.backpressure is not None:
                    state.backpressure.reset()
            for req_id in self.requests.reset():
                self._tiers_hear_finished(req_id)

    async def clear_tiers(self) -> list[str]:
        """Ask every tier to drop what it holds once nothing is in flight; the labels
        of those that kept some."""
        await self.settle(include_tier_pins=False, include_late=False)
        kept = [state.label for state in self.tiers if not await state.runner.clear()]
        with self.lock:
            self.requests.clear_answers()
        return kept

    # ------------------------------------------------------ start and close

    async def _start_tiers(self) -> None:
        await start_in_order(self._runners)

    async def _close_tiers(self) -> None:
        """On the tier loop, once: what was queued goes, what is in flight ends."""
        with self.lock:
            self.promotions.drop_all()
        await self.life.wait_started()
        await aclose_all("manager", list(reversed(self._runners)))
        with self.lock:
            self.poll()
            self.report.flush()
        self.metrics.pull_from(None)
        if self.region is not None:
            await aclose_all("manager", [self.region])


def _deliver(request: PinRequest, rows: dict[OffloadKey, memoryview], core: TieringCore) -> None:
    """On the tier's loop: hand the pinned rows over, or give them back if the tier
    stopped waiting."""
    future: asyncio.Future[dict[OffloadKey, memoryview]] = request.future
    if future.done():
        core.completions.post(UnpinRequest(request.holder, tuple(rows)))
    else:
        future.set_result(rows)


def _launch_all(
    runners: Sequence[TierRunner],
    jobs: Sequence[tuple[int, TransferJob]],
    lookups: _Lookups,
    submitted: float,
) -> None:
    for index, batch in lookups:
        runners[index].launch_lookup(batch)
    for index, job in jobs:
        runners[index].launch_job(job, submitted)
