"""Promotions, from the hit that allocates a primary slot to the job that fills it.

A secondary-tier hit allocates its slot at once, so a key is promoted once, and queues
the key for its (tier, request). The end of the step seals the step's promotions; they
then start as jobs, one per (tier, request), oldest hit first, while the tier's chunk
budget (``max_promotion_chunks``) allows, and each finished job lets the next ones go.
Everything here runs under the manager's lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from kvtier.keys import OffloadKey
from kvtier.metrics import Names
from kvtier.primary import PrimaryTier
from kvtier.tiering.jobs import JobTable
from kvtier.tiering.lookups import Promotion, TierState
from kvtier.tiering.requests import RequestTable
from kvtier.tiering.stats import Counts

__all__ = ["Launch", "Promotions"]

#: A call to make on the tier loop, with its arguments.
Launch = tuple[Callable[..., None], tuple[Any, ...]]


class Promotions:
    """The promotions of every tier: queued, waiting for a job, and started."""

    def __init__(
        self,
        primary: PrimaryTier,
        jobs: JobTable,
        requests: RequestTable,
        counts: Counts,
        evicted: Callable[[Sequence[OffloadKey]], None],
        tiers: Sequence[TierState],
    ) -> None:
        self._primary = primary
        self._tiers = tiers
        self._jobs = jobs
        self._requests = requests
        self._counts = counts
        self._evicted = evicted

    def begin(
        self,
        state: TierState,
        key: OffloadKey,
        req_id: str,
        protected: Collection[OffloadKey] | None,
    ) -> bool:
        """Allocate a slot for ``key`` and queue it; False (counted) if there is none.

        Eviction spares ``protected``: the prefix the lookup is resolving.
        """
        out = self._primary.prepare_write([key], protected)
        if out is None or not out.keys_to_store:
            self._counts.counters[Names.PROMOTION_ALLOCATION_FAILURES] += 1
            return False
        self._evicted(out.evicted_keys)
        promotion = state.promotions.get(req_id)
        if promotion is None:
            promotion = state.promotions[req_id] = Promotion(since=time.perf_counter())
        promotion.keys.append(key)
        promotion.slots.append(out.store_spec.chunk_ids[0])
        return True

    def end_step(self, state: TierState, now: float, launches: list[Launch]) -> None:
        """The step ended: its promotions join the waiting ones; start what may start."""
        state.seal_promotions()
        self._start(state, now, launches)

    def start_waiting(self, now: float) -> list[Launch]:
        """Promotion jobs ended: the waiting promotions that may start now."""
        launches: list[Launch] = []
        for state in self._tiers:
            if state.ready:
                self._start(state, now, launches)
        return launches

    def drop_request(self, req_id: str) -> None:
        """The request finished: its promotions not started yet free their slots."""
        for state in self._tiers:
            for promotion in state.drop_promotions(req_id):
                self._primary.complete_write(promotion.keys, False)

    def drop_all(self) -> None:
        """Drop every lookup and promotion not sent yet: their slots were never written."""
        for state in self._tiers:
            for promotion in state.drop_queued():
                self._primary.complete_write(promotion.keys, False)

    def _start(self, state: TierState, now: float, launches: list[Launch]) -> None:
        for job in self._jobs.promotions(state, now):
            self._requests.started(job.req_id)
            launches.append((state.runner.launch_job, (job, now)))
