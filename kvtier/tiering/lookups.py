"""The manager's view of one secondary tier: answers, queued work, jobs in flight.

Everything here is touched by the manager only, under its lock. Lookups are answered
from the tier's memory when it can (:meth:`SecondaryTier.contains`), else queued and
sent as one batch per step; the answers are kept per request until it finishes, so a
request sees one consistent answer while its promotions run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.keys import OffloadKey
from kvtier.metrics import MetricsRecorder, Names
from kvtier.tiering.backpressure import Backpressure
from kvtier.tiering.outcomes import LookupOutcome
from kvtier.tiering.runner import TierRunner
from kvtier.tiering.stats import Counts

__all__ = ["PrefixLookup", "Promotion", "TierState"]


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """What one :meth:`~TieringOffloadingManager.lookup_prefix` call found."""

    #: Keys readable now, pinned for the request, with their slots.
    pinned: dict[OffloadKey, int]
    #: Whether some key before the first miss is still on its way (written, promoted,
    #: or asked of a tier): worth waiting for.
    pending: bool


@dataclass(slots=True)
class Promotion:
    """Keys a request will promote from one tier at the end of the step."""

    keys: list[OffloadKey] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    since: float = 0.0


class TierState:
    """One secondary tier as the manager sees it."""

    def __init__(self, runner: TierRunner, backpressure: Backpressure | None) -> None:
        self.runner = runner
        self.tier = runner.tier
        self.label = runner.label
        self.backpressure = backpressure
        #: Resolved answers, per request, per key.
        self.answers: dict[str, dict[OffloadKey, bool]] = {}
        #: Keys queued or in flight for an async lookup -> the requests waiting.
        self.asking: dict[OffloadKey, set[str]] = {}
        self.asked_at: dict[OffloadKey, float] = {}
        self.queued: list[OffloadKey] = []
        self.lookups_in_flight = 0
        #: Promotions queued during the current step, by request.
        self.promotions: dict[str, Promotion] = {}
        #: Promotions of past steps waiting for a free job, oldest first.
        self.ready: dict[str, Promotion] = {}
        settings = runner.settings
        self.max_promotion_chunks = settings.max_promotion_chunks
        self.active_promotions = 0
        self.active_cascades = 0
        self.write_chunks = 0
        self.read_chunks = 0
        self.counts = Counts(self.label)
        self._integrity_reported = 0

    @property
    def busy(self) -> bool:
        return bool(self.queued or self.promotions or self.ready or self.lookups_in_flight)

    # ------------------------------------------------------------- answers

    def answer(self, key: OffloadKey, req_id: str) -> bool | None:
        """Whether the tier holds ``key`` for this request; None while it is being asked."""
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
            counts = self.counts
            counts.samples[Names.LOOKUP_SYNC_DELAY].append(time.perf_counter() - started)
            counts.counters[Names.CHUNK_QUERIES] += 1
            counts.counters[Names.CHUNK_HITS] += quick
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

    def seal_promotions(self) -> None:
        """The step ended: its promotions join those waiting for a job."""
        for req_id, promotion in self.promotions.items():
            waiting = self.ready.get(req_id)
            if waiting is None:
                self.ready[req_id] = promotion
            else:
                waiting.keys.extend(promotion.keys)
                waiting.slots.extend(promotion.slots)
        self.promotions.clear()

    def take_promotions(self) -> list[tuple[str, Promotion]]:
        """The waiting promotions that may start now, oldest first: while fewer than
        ``max_promotion_chunks`` chunks are being promoted, and always one if none is."""
        limit = self.max_promotion_chunks
        if limit is None:
            taken = list(self.ready.items())
            self.ready.clear()
            return taken
        taken = []
        in_flight = self.write_chunks  # promotion chunks only: 0 when none is running
        while self.ready and (in_flight < limit or in_flight == 0):
            req_id = next(iter(self.ready))
            promotion = self.ready.pop(req_id)
            taken.append((req_id, promotion))
            in_flight += len(promotion.keys)
        return taken

    def drop_promotions(self, req_id: str) -> list[Promotion]:
        """Forget the request's promotions not sent yet; returns them."""
        dropped = [self.promotions.pop(req_id, None), self.ready.pop(req_id, None)]
        return [promotion for promotion in dropped if promotion is not None]

    def take_queued(self) -> tuple[OffloadKey, ...] | None:
        """The step's queued lookups as one batch, now in flight; None if there are none."""
        if not self.queued:
            return None
        keys = tuple(self.queued)
        self.queued = []
        self.lookups_in_flight += 1
        return keys

    def lookup_done(self, outcome: LookupOutcome) -> None:
        self.lookups_in_flight -= 1
        answers = outcome.answers or (False,) * len(outcome.keys)
        now = time.perf_counter()
        counts = self.counts
        if outcome.answers is None:  # the batch failed or timed out: misses, counted
            counts.counters[Names.LOOKUP_FAILURES] += len(outcome.keys)
        delays = counts.samples[Names.LOOKUP_ASYNC_DELAY]
        for key, present in zip(outcome.keys, answers, strict=True):
            waiting = self.asking.pop(key, ())
            asked = self.asked_at.pop(key, None)
            if asked is not None:
                delays.append(now - asked)
            counts.counters[Names.CHUNK_QUERIES] += 1
            counts.counters[Names.CHUNK_HITS] += present
            for req_id in waiting:
                self.remember(req_id, key, present)

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

    def drop_queued(self) -> list[Promotion]:
        """Forget lookups and promotions not sent yet; returns the promotions dropped."""
        dropped = [*self.promotions.values(), *self.ready.values()]
        self.promotions.clear()
        self.ready.clear()
        for key in self.queued:
            self.asking.pop(key, None)
            self.asked_at.pop(key, None)
        self.queued = []
        return dropped

    # ------------------------------------------------------------- metrics

    def flush(self, metrics: MetricsRecorder, num_chunks: int) -> None:
        self.counts.flush(metrics)
        label = self.counts.labels
        metrics.set(Names.PRIMARY_WRITE_USAGE_PERC, self.write_chunks / num_chunks, label)
        metrics.set(Names.PRIMARY_READ_USAGE_PERC, self.read_chunks / num_chunks, label)
        metrics.set(Names.ACTIVE_PROMOTION_JOBS, self.active_promotions, label)
        metrics.set(Names.ACTIVE_CASCADE_JOBS, self.active_cascades, label)
        integrity = self.tier.ctx.counters.integrity_failures
        metrics.inc(Names.INTEGRITY_FAILURES, integrity - self._integrity_reported, label)
        self._integrity_reported = integrity
        if self.backpressure is not None:
            metrics.set(Names.BACKPRESSURE_STORE_LATENCY_EMA, self.backpressure.ema, label)
            stores, blocks = self.backpressure.take_dropped()
            metrics.inc(Names.BACKPRESSURE_STORES_DROPPED, stores, label)
            metrics.inc(Names.BACKPRESSURE_CHUNKS_DROPPED, blocks, label)
