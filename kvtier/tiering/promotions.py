"""Promotions, from the hit that allocates a primary slot to the job that fills it.

A secondary-tier hit allocates its slot at once, so a key is promoted once, and queues
the key for its (tier, request). The end of the step seals the step's promotions; they
then start as jobs, one per (tier, request), while the tier's chunk budget
(``max_promotion_chunks``) allows, and each finished job lets the next ones go.

The queue serves requests in their turn: the order in which they first queued a
promotion, kept until they finish. A request's later hits (the rest of its prompt,
found a step later) join it in its place instead of queueing behind the requests that
came since, and a request's chunks all start before the next request's. So the
request admitted first finishes first, and a request waits for the requests before it,
not for the whole queue: with every request's jobs behind everyone's, each request
would wait about as long as the slowest.

This module is the only one that changes the promotion queue. Everything here runs
under the manager's lock.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from kvtier.keys import OffloadKey
from kvtier.metrics import Names
from kvtier.primary import PrimaryTier
from kvtier.records import LookupResult
from kvtier.tiering.admission import Deadlines, PromotionCosts
from kvtier.tiering.jobs import JobTable
from kvtier.tiering.lookups import TierLookups
from kvtier.tiering.stats import Counts
from kvtier.tiers.base import TransferJob

__all__ = ["Promotions"]

_HIT_PENDING, _MISS, _RETRY = LookupResult.HIT_PENDING, LookupResult.MISS, LookupResult.RETRY


@dataclass(slots=True)
class _Queued:
    """Keys a request will promote from one tier, with the slots allocated for them."""

    keys: list[OffloadKey] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    since: float = 0.0
    #: The request's turn: lower is served first.
    turn: int = 0


class _TierQueue:
    """One tier's promotions: this step's, and those of past steps waiting for a job."""

    __slots__ = ("budget", "chunks", "step", "waiting")

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.step: dict[str, _Queued] = {}
        #: In turn order.
        self.waiting: dict[str, _Queued] = {}
        #: Chunks in ``step`` and ``waiting`` together.
        self.chunks = 0

    def queued_before(self, turn: int | None) -> int:
        """Chunks queued here that start no later than those of the request whose
        turn is ``turn`` (its own included); all of them for a request with no turn
        yet, which will queue last."""
        if turn is None:
            return self.chunks
        return sum(
            len(queued.keys)
            for queued in (*self.step.values(), *self.waiting.values())
            if queued.turn <= turn
        )

    def queued_for(self, req_id: str) -> int:
        """Chunks of the request queued here (this step's and waiting)."""
        step, waiting = self.step.get(req_id), self.waiting.get(req_id)
        return (len(step.keys) if step else 0) + (len(waiting.keys) if waiting else 0)

    def seal(self) -> None:
        """The step's promotions join the waiting ones, each request's in its turn."""
        waiting = self.waiting
        last = next(reversed(waiting.values())).turn if waiting else -1
        in_order = True
        for req_id, queued in self.step.items():
            earlier = waiting.get(req_id)
            if earlier is None:
                waiting[req_id] = queued
                in_order = in_order and queued.turn > last
                last = max(last, queued.turn)
            else:
                earlier.keys.extend(queued.keys)
                earlier.slots.extend(queued.slots)
        self.step.clear()
        if not in_order:  # an earlier request came back after later ones queued
            self.waiting = dict(sorted(waiting.items(), key=lambda item: item[1].turn))

    def take(self, in_flight_chunks: int) -> list[tuple[str, _Queued]]:
        """The waiting promotions that may start now, in turn order: while fewer than
        ``budget`` chunks are being promoted, and always one if none is."""
        if self.budget is None:
            taken = list(self.waiting.items())
            self.waiting.clear()
        else:
            taken = []
            while self.waiting and (in_flight_chunks < self.budget or in_flight_chunks == 0):
                req_id = next(iter(self.waiting))
                queued = self.waiting.pop(req_id)
                taken.append((req_id, queued))
                in_flight_chunks += len(queued.keys)
        self.chunks -= sum(len(queued.keys) for _, queued in taken)
        return taken


class Promotions:
    """The promotions of every tier: queued, waiting for a job, and started."""

    def __init__(
        self,
        primary: PrimaryTier,
        jobs: JobTable,
        counts: Counts,
        budgets: Sequence[int | None],
        costs: PromotionCosts,
        lookups: Sequence[TierLookups],
        tier_counts: Sequence[Counts],
        deadlines: Deadlines,
        labels: Sequence[str],
    ) -> None:
        self._labels = list(labels)
        self._deadlines = deadlines
        self._primary = primary
        self._jobs = jobs
        self._counts = counts
        self._queues = [_TierQueue(budget) for budget in budgets]
        self._costs = costs
        self._lookups = lookups
        self._tier_counts = tier_counts
        #: Each request's turn, from its first queued promotion until it finishes.
        self._turns: dict[str, int] = {}
        self._next_turn = 0
        #: The tier each key queued or being promoted comes from.
        self._tier_of: dict[OffloadKey, int] = {}
        #: Per request, the tier each key it promoted came from, until it finishes.
        self._sources: dict[str, dict[OffloadKey, int]] = {}

    def resolve(
        self,
        key: OffloadKey,
        req_id: str,
        protected: Collection[OffloadKey] | None,
        load_tiers: frozenset[str] | None = None,
    ) -> tuple[LookupResult, list[OffloadKey]]:
        """Ask the secondary tiers for a key the primary tier lacks, in order; the
        answer, and the keys evicted to make room for its promotion.

        The first tier that holds the key promotes it (HIT_PENDING), unless the
        promotion would arrive after the host could recompute the chunk (a counted
        MISS) or no slot can be had (a counted MISS). A tier still being asked makes
        the answer RETRY if no later tier has the key. A promotion adds what it is
        worth waiting for to the request's deadline. Tiers whose label is not in
        ``load_tiers`` (when given) are not asked.
        """
        retry = False
        for tier, lookups in enumerate(self._lookups):
            if load_tiers is not None and self._labels[tier] not in load_tiers:
                continue
            present = lookups.answer(key, req_id)
            if present is None:
                retry = True
            elif present:
                if not self.worth_it(tier, req_id):
                    self._tier_counts[tier].counters[Names.SKIPPED_SLOWER_THAN_RECOMPUTE] += 1
                    return _MISS, []
                evicted = self.begin(tier, key, req_id, protected)
                if evicted is None:
                    return _MISS, []
                self.allow_wait(key, req_id)
                return _HIT_PENDING, evicted
        return (_RETRY if retry else _MISS), []

    def worth_it(self, tier: int, req_id: str) -> bool:
        """Whether one more chunk promoted for the request from ``tier`` would arrive
        before the host could recompute it (:mod:`~kvtier.tiering.admission`)."""
        if not self._costs.weighs(tier):
            return True
        queue = self._queues[tier]
        ahead = self._jobs.in_flight[tier].promotion_chunks
        ahead += queue.queued_before(self._turns.get(req_id))
        return not self._costs.loses(tier, ahead, queue.queued_for(req_id))

    def allow_wait(self, key: OffloadKey, req_id: str) -> None:
        """The request waits for ``key``, queued or being promoted: add what the chunk is
        worth waiting for to its deadline (:meth:`PromotionCosts.wait_allowance`), once
        per key. A key that is not being promoted (a store writing it) adds nothing.
        A waiting request looks its pending keys up every step: the allowance is worked
        out the first time only."""
        tier = self._tier_of.get(key)
        if tier is not None and not self._deadlines.allowed(req_id, key):
            self._deadlines.allow(req_id, key, self._costs.wait_allowance(tier))

    def ended(self, keys: Sequence[OffloadKey]) -> None:
        """A promotion job of ``keys`` ended (loaded, failed or timed out)."""
        tier_of = self._tier_of
        for key in keys:
            tier_of.pop(key, None)

    def forget_sources(self, req_id: str) -> None:
        """The request finished: its record of where its promotions came from goes."""
        self._sources.pop(req_id, None)

    def source_of(self, key: OffloadKey, req_id: str) -> str | None:
        """The label of the tier that promoted ``key`` for the request, if one did."""
        tier = self._sources.get(req_id, {}).get(key)
        return None if tier is None else self._labels[tier]

    def busy(self, tier: int) -> bool:
        """Whether promotions of ``tier`` are queued or waiting for a job."""
        queue = self._queues[tier]
        return bool(queue.step or queue.waiting)

    def begin(
        self,
        tier: int,
        key: OffloadKey,
        req_id: str,
        protected: Collection[OffloadKey] | None,
    ) -> list[OffloadKey] | None:
        """Allocate a slot for ``key`` and queue it; the keys evicted for the slot, or
        None (counted) if there is no slot.

        Eviction spares ``protected``: the prefix the lookup is resolving.
        """
        out = self._primary.prepare_write([key], protected)
        if out is None or not out.keys_to_store:
            self._counts.counters[Names.PROMOTION_ALLOCATION_FAILURES] += 1
            return None
        step = self._queues[tier].step
        queued = step.get(req_id)
        if queued is None:
            queued = step[req_id] = _Queued(since=time.perf_counter(), turn=self._turn(req_id))
        queued.keys.append(key)
        queued.slots.append(out.store_spec.chunk_ids[0])
        self._queues[tier].chunks += 1
        self._tier_of[key] = tier
        sources = self._sources.get(req_id)
        if sources is None:
            sources = self._sources[req_id] = {}
        sources[key] = tier
        return out.evicted_keys

    def end_step(self, tier: int, now: float) -> list[TransferJob]:
        """The step ended: its promotions join the waiting ones; the jobs that start."""
        self._queues[tier].seal()
        return self._start(tier, now)

    def start_waiting(self, now: float) -> list[tuple[int, TransferJob]]:
        """Promotion jobs ended: the waiting promotions that may start now."""
        return [
            (tier, job)
            for tier, queue in enumerate(self._queues)
            if queue.waiting
            for job in self._start(tier, now)
        ]

    def drop_request(self, req_id: str) -> None:
        """The request finished (or gave up waiting): its promotions not started yet
        free their slots."""
        self._turns.pop(req_id, None)
        for queue in self._queues:
            for queued in (queue.step.pop(req_id, None), queue.waiting.pop(req_id, None)):
                if queued is not None:
                    queue.chunks -= len(queued.keys)
                    self.ended(queued.keys)
                    self._primary.complete_write(queued.keys, False)

    def drop_all(self) -> None:
        """Drop every promotion not sent yet: their slots were never written."""
        self._turns.clear()
        self._sources.clear()
        for queue in self._queues:
            for queued in (*queue.step.values(), *queue.waiting.values()):
                self.ended(queued.keys)
                self._primary.complete_write(queued.keys, False)
            queue.step.clear()
            queue.waiting.clear()
            queue.chunks = 0

    def _turn(self, req_id: str) -> int:
        turn = self._turns.get(req_id)
        if turn is None:
            turn = self._turns[req_id] = self._next_turn
            self._next_turn += 1
        return turn

    def _start(self, tier: int, now: float) -> list[TransferJob]:
        jobs = self._jobs
        in_flight = jobs.in_flight[tier].promotion_chunks
        return [
            jobs.promotion(tier, queued.keys, queued.slots, req_id, queued.since, now)
            for req_id, queued in self._queues[tier].take(in_flight)
        ]
