"""What each secondary tier answered: lookups from the question to the kept answer.

A lookup is answered from the tier's memory when it can
(:meth:`SecondaryTier.contains`), else queued and sent as one batch per step; the
answers are kept per request until it finishes, so a request sees one consistent answer
while its promotions run. This module is the only one that changes these answers.
Everything here runs under the manager's lock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.keys import OffloadKey
from kvtier.metrics import Names
from kvtier.tiering.outcomes import LookupOutcome
from kvtier.tiering.stats import Counts
from kvtier.tiers.base import SecondaryTier

__all__ = ["PrefixLookup", "TierLookups"]


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """What one :meth:`~kvtier.tiering.host.HostAccess.lookup_prefix` call found."""

    #: Keys readable now, pinned for the request, with their slots.
    pinned: dict[OffloadKey, int]
    #: Whether some key before the first miss is still on its way (written, promoted,
    #: or asked of a tier): worth waiting for.
    pending: bool
    #: :attr:`~kvtier.tiering.host.HostAccess.completion_mark` as the lookup began:
    #: wait with it, and what completes between this answer and the wait is not missed.
    mark: int


class TierLookups:
    """One tier's answers, per request, and the questions on their way to it."""

    def __init__(self, tier: SecondaryTier, counts: Counts) -> None:
        self._tier = tier
        self._counts = counts
        #: Resolved answers, per request, per key.
        self._answers: dict[str, dict[OffloadKey, bool]] = {}
        #: Keys queued or in flight for an async lookup -> the requests waiting.
        self._asking: dict[OffloadKey, set[str]] = {}
        self._asked_at: dict[OffloadKey, float] = {}
        self._queued: list[OffloadKey] = []
        self._in_flight = 0

    @property
    def busy(self) -> bool:
        """Whether a lookup is queued or in flight."""
        return bool(self._queued or self._in_flight)

    def answer(self, key: OffloadKey, req_id: str) -> bool | None:
        """Whether the tier holds ``key`` for this request; None while it is being asked."""
        per_request = self._answers.get(req_id)
        if per_request is not None:
            known = per_request.get(key)
            if known is not None:
                return known
        waiting = self._asking.get(key)
        if waiting is not None:
            waiting.add(req_id)
            return None
        started = time.perf_counter()
        quick = self._tier.contains(key)
        if quick is not None:
            counts = self._counts
            counts.samples[Names.LOOKUP_SYNC_DELAY].append(time.perf_counter() - started)
            counts.counters[Names.CHUNK_QUERIES] += 1
            counts.counters[Names.CHUNK_HITS] += quick
            self._remember(req_id, key, quick)
            return quick
        self._asking[key] = {req_id}
        self._asked_at[key] = started
        self._queued.append(key)
        return None

    def _remember(self, req_id: str, key: OffloadKey, present: bool) -> None:
        per_request = self._answers.get(req_id)
        if per_request is None:
            per_request = self._answers[req_id] = {}
        per_request[key] = present

    def take_queued(self) -> tuple[OffloadKey, ...] | None:
        """The step's queued lookups as one batch, now in flight; None if there are none."""
        if not self._queued:
            return None
        keys = tuple(self._queued)
        self._queued = []
        self._in_flight += 1
        return keys

    def lookup_done(self, outcome: LookupOutcome) -> None:
        """A batch came back: keep its answers for the requests that asked."""
        self._in_flight -= 1
        answers = outcome.answers or (False,) * len(outcome.keys)
        now = time.perf_counter()
        counts = self._counts
        if outcome.answers is None:  # the batch failed or timed out: misses, counted
            counts.counters[Names.LOOKUP_FAILURES] += len(outcome.keys)
        delays = counts.samples[Names.LOOKUP_ASYNC_DELAY]
        for key, present in zip(outcome.keys, answers, strict=True):
            waiting = self._asking.pop(key, ())
            asked = self._asked_at.pop(key, None)
            if asked is not None:
                delays.append(now - asked)
            counts.counters[Names.CHUNK_QUERIES] += 1
            counts.counters[Names.CHUNK_HITS] += present
            for req_id in waiting:
                self._remember(req_id, key, present)

    def forget_hits(self, keys: Sequence[OffloadKey], failed_for: str) -> None:
        """A load of ``keys`` for request ``failed_for`` failed.

        Other requests ask the tier again instead of trusting an old hit; the request
        whose load failed takes them as misses, so that a tier which keeps claiming a
        chunk it cannot deliver never holds a request in a loop of promotions.
        """
        lost = set(keys)
        for per_request in self._answers.values():
            for key in lost.intersection(per_request):
                del per_request[key]
        for key in lost:
            self._remember(failed_for, key, False)

    def forget_request(self, req_id: str) -> None:
        self._answers.pop(req_id, None)
        for waiting in self._asking.values():
            waiting.discard(req_id)

    def drop_queued(self) -> None:
        """Forget the lookups not sent yet."""
        for key in self._queued:
            self._asking.pop(key, None)
            self._asked_at.pop(key, None)
        self._queued = []

    def clear_answers(self) -> None:
        """Forget every kept answer (the primary tier was reset, or the tier cleared)."""
        self._answers.clear()
