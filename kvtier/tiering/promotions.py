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

Load or recompute: a secondary-tier hit is worth promoting only if the chunk reaches
the primary tier before the host could have recomputed it. The host says what
recomputing costs (seconds of prefill per chunk: ``recompute_s_per_chunk`` in the
configuration, or :meth:`~kvtier.tiering.host.HostAccess.set_recompute_cost` as it
measures); kvtier learns what a promotion costs from its own jobs
(:class:`PromotionCosts`). For a request asking a tier for its n-th chunk of the step,
the promotion's estimate is the tier's measured seconds per chunk times the chunks
ahead of it (in flight, and queued for the requests whose turn comes before it, its own
included) plus one; recomputing it costs the request's n chunks. A hit whose promotion
would arrive later is answered as a miss and counted.

Seconds per chunk are a moving average of finished promotion jobs (job time over the
chunks it moved; a job that timed out counts with its time-out). Until a tier has
finished a job there is nothing to go by, and its hits are promoted; so too once its
last finished job is older than :data:`STALE_AFTER_S`, since a tier that loses gets no
jobs that would notice it recover.

What a wait may cost: once the host's cost is known, a request waits for its promoted
chunks no longer than recomputing them would take, and for chunks of a tier not
measured yet no longer than :data:`EXPLORE_SHARE` of that. Such a promotion is a probe
whose cost nobody knows: should the tier have become a slow link, the request gives up
early and recomputes, and the job, which goes on, measures the tier for the requests
after it. The allowance goes to the request's deadline
(:meth:`~kvtier.tiering.requests.RequestTable.allow`).

This module is the only one that changes the promotion queue; a request's turn and
sources are kept in its record (:mod:`~kvtier.tiering.requests`). Everything here runs
under the manager's lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.keys import OffloadKey
from kvtier.metrics import Names
from kvtier.records import LookupResult
from kvtier.tiering.requests import Request
from kvtier.tiers.base import TransferJob

if TYPE_CHECKING:
    from kvtier.tiering.core import TieringCore

__all__ = ["EXPLORE_SHARE", "STALE_AFTER_S", "PromotionCosts", "Promotions"]

_HIT_PENDING, _MISS, _RETRY = LookupResult.HIT_PENDING, LookupResult.MISS, LookupResult.RETRY

# Weight of the newest job in the moving average: about the last five jobs count,
# so a tier that slows down (a throttled link, a busy disk) is noticed within a few
# requests, and one slow job does not turn a fast tier off.
_ALPHA = 0.3
# A tier found slower than recomputing gets no promotions, so nothing measures it again:
# a measurement this old is forgotten, and the tier's next hit is promoted and measured.
# A link that recovered is noticed within a minute; one that did not costs one request
# in a minute the wait for one promotion (bounded by the host's deadline).
STALE_AFTER_S = 60.0
# What a request may lose to a promotion from a tier not measured yet: this share of
# the time recomputing its chunks takes. A healthy tier promotes in a small part of
# that (a disk read of a chunk against a prefill of it), so the probe is rarely cut
# short, and one that is measures the tier anyway.
EXPLORE_SHARE = 0.1


class PromotionCosts:
    """Measured promotion cost per tier, and the host's recompute cost."""

    def __init__(
        self,
        tiers: int,
        recompute_s_per_chunk: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.recompute_s_per_chunk = recompute_s_per_chunk
        #: Seconds per chunk of each tier's promotion jobs; None before the first.
        self.per_chunk_s: list[float | None] = [None] * tiers
        self._measured_at = [0.0] * tiers
        self._clock = clock

    def job_done(self, tier: int, seconds: float, chunks: int) -> None:
        """A promotion job of ``tier`` moved ``chunks`` chunks in ``seconds``."""
        if chunks <= 0:
            return
        sample = seconds / chunks
        current = self.per_chunk_s[tier]
        self.per_chunk_s[tier] = (
            sample if current is None else current + _ALPHA * (sample - current)
        )
        self._measured_at[tier] = self._clock()

    def weighs(self, tier: int) -> bool:
        """Whether promotions from ``tier`` are weighed at all: the host gave its cost
        and the tier has finished a promotion job."""
        if self.recompute_s_per_chunk is None or self.per_chunk_s[tier] is None:
            return False
        if self._clock() - self._measured_at[tier] > STALE_AFTER_S:
            self.per_chunk_s[tier] = None
            return False
        return True

    def wait_allowance(self, tier: int) -> float | None:
        """How long a request may wait for one more chunk promoted from ``tier``:
        recomputing it, or :data:`EXPLORE_SHARE` of that while the tier is not measured;
        None while the host's cost is unknown (no bound)."""
        recompute = self.recompute_s_per_chunk
        if recompute is None:
            return None
        return recompute if self.weighs(tier) else EXPLORE_SHARE * recompute

    def loses(self, tier: int, ahead: int, own: int) -> bool:
        """Whether promoting one more chunk from ``tier`` would take longer than
        recomputing it: ``ahead`` chunks are before it on the tier (the request's
        ``own`` among them, already promoted this step)."""
        recompute = self.recompute_s_per_chunk
        per_chunk = self.per_chunk_s[tier]
        if recompute is None or per_chunk is None:
            return False
        return (ahead + 1) * per_chunk > (own + 1) * recompute


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

    def __init__(self, core: TieringCore) -> None:
        self._core = core
        self._queues = [
            _TierQueue(state.runner.settings.max_promotion_chunks) for state in core.tiers
        ]
        #: The tier each key queued or being promoted comes from.
        self._tier_of: dict[OffloadKey, int] = {}

    def resolve(
        self,
        key: OffloadKey,
        request: Request,
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
        for tier, state in enumerate(self._core.tiers):
            if load_tiers is not None and state.label not in load_tiers:
                continue
            present = state.answer(key, request)
            if present is None:
                retry = True
            elif present:
                if not self.worth_it(tier, request):
                    state.counts.counters[Names.SKIPPED_SLOWER_THAN_RECOMPUTE] += 1
                    return _MISS, []
                evicted = self.begin(tier, key, request, protected)
                if evicted is None:
                    return _MISS, []
                self.allow_wait(key, request)
                return _HIT_PENDING, evicted
        return (_RETRY if retry else _MISS), []

    def worth_it(self, tier: int, request: Request) -> bool:
        """Whether one more chunk promoted for the request from ``tier`` would arrive
        before the host could recompute it."""
        costs = self._core.costs
        if not costs.weighs(tier):
            return True
        queue = self._queues[tier]
        ahead = self._core.jobs.in_flight[tier].promotion_chunks
        ahead += queue.queued_before(request.turn)
        return not costs.loses(tier, ahead, queue.queued_for(request.req_id))

    def allow_wait(self, key: OffloadKey, request: Request) -> None:
        """The request waits for ``key``, queued or being promoted: add what the chunk is
        worth waiting for to its deadline (:meth:`PromotionCosts.wait_allowance`), once
        per key. A key that is not being promoted (a store writing it) adds nothing.
        A waiting request looks its pending keys up every step: the allowance is worked
        out the first time only."""
        tier = self._tier_of.get(key)
        if tier is None:
            return
        allowed = request.allowed
        if allowed is None or key not in allowed:
            core = self._core
            core.requests.allow(request, key, core.costs.wait_allowance(tier))

    def ended(self, keys: Sequence[OffloadKey]) -> None:
        """A promotion job of ``keys`` ended (loaded, failed or timed out)."""
        tier_of = self._tier_of
        for key in keys:
            tier_of.pop(key, None)

    def busy(self, tier: int) -> bool:
        """Whether promotions of ``tier`` are queued or waiting for a job."""
        queue = self._queues[tier]
        return bool(queue.step or queue.waiting)

    def begin(
        self,
        tier: int,
        key: OffloadKey,
        request: Request,
        protected: Collection[OffloadKey] | None,
    ) -> list[OffloadKey] | None:
        """Allocate a slot for ``key`` and queue it; the keys evicted for the slot, or
        None (counted) if there is no slot.

        Eviction spares ``protected``: the prefix the lookup is resolving.
        """
        core = self._core
        out = core.primary.prepare_write([key], protected, request.req_id)
        if out is None or not out.keys_to_store:
            core.counts.counters[Names.PROMOTION_ALLOCATION_FAILURES] += 1
            return None
        queue = self._queues[tier]
        req_id = request.req_id
        queued = queue.step.get(req_id)
        if queued is None:
            turn = core.requests.turn_of(request)
            queued = queue.step[req_id] = _Queued(since=time.perf_counter(), turn=turn)
        queued.keys.append(key)
        queued.slots.append(out.store_spec.chunk_ids[0])
        queue.chunks += 1
        self._tier_of[key] = tier
        request.sources[key] = tier
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

    def drop_request(self, request: Request) -> None:
        """The request finished (or gave up waiting): its promotions not started yet
        free their slots, and it gives up its turn."""
        request.turn = None
        req_id = request.req_id
        for queue in self._queues:
            for queued in (queue.step.pop(req_id, None), queue.waiting.pop(req_id, None)):
                if queued is not None:
                    queue.chunks -= len(queued.keys)
                    self.ended(queued.keys)
                    self._core.primary.complete_write(queued.keys, False)

    def drop_all(self) -> None:
        """Drop every promotion not sent yet: their slots were never written."""
        primary = self._core.primary
        for queue in self._queues:
            for queued in (*queue.step.values(), *queue.waiting.values()):
                self.ended(queued.keys)
                primary.complete_write(queued.keys, False)
            queue.step.clear()
            queue.waiting.clear()
            queue.chunks = 0

    def _start(self, tier: int, now: float) -> list[TransferJob]:
        jobs = self._core.jobs
        in_flight = jobs.in_flight[tier].promotion_chunks
        return [
            jobs.promotion(tier, queued.keys, queued.slots, req_id, queued.since, now)
            for req_id, queued in self._queues[tier].take(in_flight)
        ]
