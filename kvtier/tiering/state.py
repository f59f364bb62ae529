"""One secondary tier as the manager sees it: how it runs, and what it was asked.

A :class:`TierState` ties together what concerns one tier: its runner (jobs on the
tier loop, :mod:`~kvtier.tiering.runner`), its back-pressure, its counts, and its
lookups on their way. A lookup is answered from the tier's memory when it can
(:meth:`SecondaryTier.contains`), else queued and sent as one batch per step; the
answers are kept in the asking request's record until it finishes
(:mod:`~kvtier.tiering.requests`), so a request sees one consistent answer while its
promotions run. This module is the only one that changes those answers. Everything
here runs under the manager's lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.keys import OffloadKey
from kvtier.metrics import Names
from kvtier.tiering.backpressure import Backpressure, BackpressureSettings
from kvtier.tiering.reporting import Counts
from kvtier.tiering.runner import RunnerSettings, TierRunner
from kvtier.tiers.base import SecondaryTier

if TYPE_CHECKING:
    from kvtier.tiering.completions import LookupOutcome, Outcome
    from kvtier.tiering.requests import Request, RequestTable

__all__ = ["TierOptions", "TierState"]


@dataclass(frozen=True)
class TierOptions:
    """How the framework runs one tier."""

    runner: RunnerSettings = field(default_factory=RunnerSettings)
    #: None: back-pressure is off for this tier.
    backpressure: BackpressureSettings | None = None


class TierState:
    """One secondary tier as the manager sees it."""

    __slots__ = (
        "_asked_at",
        "_asking",
        "_in_flight",
        "_queued",
        "backpressure",
        "counts",
        "index",
        "label",
        "runner",
        "tier",
    )

    def __init__(self, runner: TierRunner, backpressure: Backpressure | None) -> None:
        self.runner = runner
        self.index = runner.index
        self.tier = runner.tier
        self.label = runner.label
        self.backpressure = backpressure
        self.counts = Counts(self.label)
        #: Keys queued or in flight for an async lookup -> the requests waiting.
        self._asking: dict[OffloadKey, set[str]] = {}
        self._asked_at: dict[OffloadKey, float] = {}
        self._queued: list[OffloadKey] = []
        self._in_flight = 0

    @classmethod
    def build(
        cls,
        tiers: Sequence[SecondaryTier],
        options: Sequence[TierOptions],
        post: Callable[[Outcome], None],
    ) -> list[TierState]:
        """One state per tier, its runner posting outcomes through ``post``."""
        return [
            cls(
                TierRunner(index, tier, opt.runner, post),
                Backpressure(opt.backpressure) if opt.backpressure is not None else None,
            )
            for index, (tier, opt) in enumerate(zip(tiers, options, strict=True))
        ]

    # -------------------------------------------------------------- lookups

    @property
    def asking(self) -> bool:
        """Whether a lookup is queued or in flight."""
        return bool(self._queued or self._in_flight)

    def answer(self, key: OffloadKey, request: Request) -> bool | None:
        """Whether the tier holds ``key`` for this request; None while it is being asked."""
        answers = request.answers.get(self.index)
        if answers is not None:
            known = answers.get(key)
            if known is not None:
                self._count(request, key, known)
                return known
        waiting = self._asking.get(key)
        if waiting is not None:
            waiting.add(request.req_id)
            return None
        started = time.perf_counter()
        quick = self.tier.contains(key)
        if quick is not None:
            self.counts.samples[Names.LOOKUP_SYNC_DELAY].append(time.perf_counter() - started)
            self._count(request, key, quick)
            self._remember(request, key, quick)
            return quick
        self._asking[key] = {request.req_id}
        self._asked_at[key] = started
        self._queued.append(key)
        return None

    def _count(self, request: Request, key: OffloadKey, present: bool) -> None:
        """The request sees the tier's answer for ``key``: counted the first time only
        (:meth:`~kvtier.tiering.requests.Request.counts_answer`)."""
        if request.counts_answer(self.index, key):
            counters = self.counts.counters
            counters[Names.CHUNK_QUERIES] += 1
            counters[Names.CHUNK_HITS] += present

    def _remember(self, request: Request, key: OffloadKey, present: bool) -> None:
        answers = request.answers.get(self.index)
        if answers is None:
            answers = request.answers[self.index] = {}
        answers[key] = present

    def take_queued(self) -> tuple[OffloadKey, ...] | None:
        """The step's queued lookups as one batch, now in flight; None if there are none."""
        if not self._queued:
            return None
        keys = tuple(self._queued)
        self._queued = []
        self._in_flight += 1
        return keys

    def lookup_done(self, outcome: LookupOutcome, requests: RequestTable) -> None:
        """A batch came back: keep its answers for the requests that asked."""
        self._in_flight -= 1
        answers = outcome.answers or (False,) * len(outcome.keys)
        now = time.perf_counter()
        counts = self.counts
        if outcome.answers is None:  # the batch failed or timed out: misses, counted
            counts.counters[Names.LOOKUP_FAILURES] += len(outcome.keys)
        delays = counts.samples[Names.LOOKUP_ASYNC_DELAY]
        for key, present in zip(outcome.keys, answers, strict=True):
            waiting = self._asking.pop(key, ())
            asked = self._asked_at.pop(key, None)
            if asked is not None:
                delays.append(now - asked)
            for req_id in waiting:
                request = requests.get(req_id)
                if request is not None and not request.finished:
                    self._remember(request, key, present)

    def forget_hits(
        self, keys: Sequence[OffloadKey], failed_for: Request | None, requests: RequestTable
    ) -> None:
        """A load of ``keys`` for the request ``failed_for`` failed.

        Other requests ask the tier again instead of trusting an old hit; the request
        whose load failed takes them as misses, so that a tier which keeps claiming a
        chunk it cannot deliver never holds a request in a loop of promotions.
        """
        lost = set(keys)
        for request in requests:
            answers = request.answers.get(self.index)
            if answers:
                for key in lost.intersection(answers):
                    del answers[key]
        if failed_for is not None and not failed_for.finished:
            for key in lost:
                self._remember(failed_for, key, False)

    def forget_request(self, req_id: str) -> None:
        """The request's tiers heard it finished: it waits for no answer any more."""
        for waiting in self._asking.values():
            waiting.discard(req_id)

    def drop_queued(self) -> None:
        """Forget the lookups not sent yet."""
        for key in self._queued:
            self._asking.pop(key, None)
            self._asked_at.pop(key, None)
        self._queued = []
