"""The scheduler-facing orchestrator of the primary and secondary tiers.

Every scheduler-facing method is synchronous and never blocks: it changes in-memory
state and hands I/O to the tier event loop through the tiering core
(:mod:`~kvtier.tiering.core`), which holds the state and makes the decisions. Tier
coroutines never touch this state; their outcomes come back through a completion queue
that the core drains at the manager's poll points (``lookup``, ``prepare_load``,
``prepare_store``, ``on_schedule_end`` and the async helpers), so the state has one
writer at a time. Who holds which primary slot is the slot ledger's record
(:mod:`~kvtier.tiering.ledger`). README "How it fits together" follows a key through
lookup, promotion, pin and load, and through store and cascade, in the order this code
runs them.
"""

from __future__ import annotations

from collections.abc import Sequence

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
from kvtier.tiering.core import TieringCore
from kvtier.tiering.host import HostAccess
from kvtier.tiering.ledger import Holder
from kvtier.tiering.loop import LoopThread, TierLoop
from kvtier.tiering.reporting import Diagnostics
from kvtier.tiering.state import TierOptions
from kvtier.tiers.base import SecondaryTier

__all__ = ["TierOptions", "TieringOffloadingManager"]


class TieringOffloadingManager(AsyncResource):
    """Keeps track of what every tier holds and moves chunks between them.

    Its methods are the scheduler protocol; what hosts need beyond it is :attr:`host`,
    counts and samples for operators :attr:`diagnostics`. Both call down to the tiering
    core (:mod:`~kvtier.tiering.core`), which holds the state and makes the decisions.

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
        if loop is not None and not tiers:
            loop.close()  # owned, and nothing will run on it
        core = self._core = TieringCore(
            primary,
            tiers,
            options,
            region=region,
            metrics=metrics if metrics is not None else MetricsRecorder({}),
            loop=loop if tiers else None,
            store_threshold=store_threshold,
            max_tracked_lookups=max_tracked_lookups,
            recompute_s_per_chunk=recompute_s_per_chunk,
            max_pending_s=max_pending_s,
        )
        self.primary = primary
        self.lock = core.lock
        self.metrics = core.metrics
        self._pending = core.pending
        self._ledger = core.ledger
        self.host = HostAccess(core)
        self.diagnostics = Diagnostics(core)
        # A scrape of an idle engine sees current counts, not those of its last step.
        self.metrics.pull_from(self._flush_for_collection)

    @property
    def region(self) -> SharedOffloadRegion | None:
        return self._core.region

    @property
    def tiers(self) -> list[SecondaryTier]:
        return [state.tier for state in self._core.tiers]

    @property
    def loop(self) -> TierLoop | None:
        """Where the tiers run; None without secondary tiers."""
        return self._core.loop

    @property
    def owns_loop(self) -> bool:
        """Whether the tiers run on a loop thread of the manager's own (a sync host)."""
        return isinstance(self._core.loop, LoopThread)

    @property
    def closed(self) -> bool:
        return self._core.life.closed

    # ---------------------------------------------------------------- start

    async def start(self) -> None:
        """Start the tiers in order. Idempotent; every caller awaits the same start.

        If a tier fails to start, the tiers already started are closed and the error
        propagates: the manager cannot be used, and :meth:`aclose` releases the rest.
        """
        await self._core.life.start()

    def start_blocking(self, timeout: float | None = None) -> None:
        """:meth:`start` for a synchronous host (not from the tier loop's thread)."""
        self._core.life.start_blocking(timeout)

    # -------------------------------------------------------------- lookups

    def lookup(self, key: OffloadKey, req: ReqContext) -> LookupResult:
        """Where ``key`` stands: HIT, HIT_PENDING, MISS or RETRY."""
        core = self._core
        with core.lock:
            if self._pending:
                core.drain()
            return core.lookup(key, req.req_id, None, req.load_tiers)

    # ---------------------------------------------------------------- loads

    def prepare_load(self, keys: Sequence[OffloadKey], req: ReqContext) -> LoadStoreSpec:
        """Pin ``keys`` (all HIT) for a primary -> GPU load; the spec gives their slots."""
        core = self._core
        with core.lock:
            if self._pending:
                core.drain()
            slots = self._ledger.pin_for_request(keys, req.req_id)
            request = core.requests.get(req.req_id)
            if request is not None and request.found:
                # The pins hold them now; once loaded, the request's own later
                # promotions may take their slots.
                request.found.difference_update(keys)
            return LoadStoreSpec(chunk_ids=slots)

    def touch(self, keys: Sequence[OffloadKey], req: ReqContext) -> None:
        """Record a use of ``keys`` (first = head of the prefix) in every tier."""
        core = self._core
        with core.lock:
            self.primary.touch(keys, req.req_id)
            for state in core.tiers:
                state.tier.touch(keys)

    def complete_load(self, keys: Sequence[OffloadKey], req: ReqContext) -> None:
        """Release the request's pins on ``keys`` after the GPU read them."""
        core = self._core
        with core.lock:
            self._ledger.release(keys, Holder.request(req.req_id))
            # A store waiting for room may now evict them.
            core.completions.notify()

    # --------------------------------------------------------------- stores

    def prepare_store(
        self, keys: Sequence[OffloadKey], req: ReqContext
    ) -> PrepareStoreOutput | None:
        """Allocate primary slots for the keys not stored yet; None if there is no room.

        A request that stores was scheduled: its lookups count no more in the tiers'
        ``chunk_queries`` and ``chunk_hits``."""
        core = self._core
        with core.lock:
            if self._pending:
                core.drain()
            core.requests.scheduled(req.req_id)
            output = self.primary.prepare_store(core.admitted(keys), owner=req.req_id)
            if output is None:
                return None
            if output.keys_to_store:
                core.counts.samples[Names.CPU_ALLOCATION_SIZE].append(len(output.keys_to_store))
                core.evicted(output.evicted_keys)
                core.requests.started(req.req_id)
            return output

    def complete_store(
        self, keys: Sequence[OffloadKey], req: ReqContext, success: bool = True
    ) -> None:
        """Finish a GPU -> primary store; on success cascade the keys to every tier."""
        core = self._core
        with core.lock:
            done = self.primary.complete_store(keys, success)
            if done:
                core.cascade(done, req.req_id)
            core.work_ended(req.req_id)
            # Lookups that saw these keys pending may be waiting for them.
            core.completions.notify()

    # ------------------------------------------------------------- requests

    def on_new_request(self, req: ReqContext) -> None:
        """A request entered the scheduler."""

    def on_request_finished(self, req: ReqContext) -> None:
        """A request left the scheduler: its promotions not yet sent and the slots it
        holds go now; tiers hear of it once its stores and promotions ended."""
        with self._core.lock:
            self._core.finish(req.req_id)

    # ----------------------------------------------------------------- steps

    def on_schedule_end(self, ctx: ScheduleEndContext | None = None) -> None:
        """End of a step: drain, send the step's lookups and promotions; flush metrics
        if the last flush is a while ago (a scrape of the registry flushes first). The
        requests ``ctx`` names as scheduled for the first time count no more lookups
        in the tiers' ``chunk_queries`` and ``chunk_hits``."""
        core = self._core
        with core.lock:
            if ctx is not None:
                for req_id in ctx.new_req_ids:
                    core.requests.scheduled(req_id)
            if self._pending:
                core.drain()
            core.launch_step()
            core.report.flush_if_due()

    def take_events(self) -> list[OffloadingEvent]:
        """Store and removal events since the last call: primary first, then each tier."""
        core = self._core
        with core.lock:
            events = self.primary.take_events()
            for state in core.tiers:
                events.extend(state.tier.take_events())
            return events

    def has_pending_work(self) -> bool:
        """Whether a job or lookup is queued or in flight, or a timed-out job still runs."""
        core = self._core
        with core.lock:
            return core.busy() or bool(core.jobs.late)

    # ---------------------------------------------------------- async helpers

    async def wait_for_completions(self, since: int | None = None) -> None:
        """Resolve once a job, lookup or store finished: after ``since`` (read from
        ``host.completion_mark`` before the host checked what it waits for), or after
        this call; at once if an outcome waits to be applied."""
        await self.host.wait_for_completions(since)

    async def drain(self) -> None:
        """Send what the step queued, resolve once nothing is in flight, flush the metrics."""
        await self.host.drain()
        with self._core.lock:
            self._core.report.flush()

    # -------------------------------------------------------------- resetting

    def reset_cache(self, *, hold_busy_slots: bool = False) -> None:
        """Wait for the jobs in flight (none is aborted), then clear the primary tier;
        secondary tiers keep their data, and their back-pressure starts afresh (a tier
        pressured before the reset gets its next cascade). Blocks: an async host awaits
        :meth:`areset_cache`.

        Slots that late I/O of a timed-out job may touch stay out of use until it stops;
        with ``hold_busy_slots``, so do those host copies were writing or reading, until
        :meth:`on_reset_flushed` (vLLM drops its copies' results at a reset).
        """
        self._core.life.block_on(lambda: self.areset_cache(hold_busy_slots=hold_busy_slots))

    async def areset_cache(self, *, hold_busy_slots: bool = False) -> None:
        """:meth:`reset_cache` for an async host."""
        await self._core.reset(hold_busy_slots=hold_busy_slots)

    def clear_tiers(self) -> list[str]:
        """Ask every secondary tier to drop the chunks it holds, once no job or lookup
        is in flight; the labels of those that kept some (a tier that cannot clear,
        failed to, or ran past its job timeout). The primary tier is left alone
        (:meth:`reset_cache` empties it). Blocks: an async host awaits
        :meth:`aclear_tiers`."""
        return self._core.life.block_on(self.aclear_tiers)

    async def aclear_tiers(self) -> list[str]:
        """:meth:`clear_tiers` for an async host."""
        return await self._core.clear_tiers()

    def on_reset_flushed(self) -> None:
        """The host's copies in flight at the last reset have ended: reuse their slots."""
        core = self._core
        with core.lock:
            self._ledger.release_host_copies()
            core.completions.notify()

    # -------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """vLLM's name for ``close()``, and the same call."""
        self.close()

    async def aclose(self) -> None:
        """Drain and close the tiers, release the region and the loop. Idempotent.

        ``close()`` is the same for a caller that may block: it waits for the jobs too.
        """
        await self._core.life.aclose()

    def _flush_for_collection(self) -> None:
        """A collection begins, on any thread: flush what this step counted so far."""
        with self._core.lock:
            self._core.report.flush()
