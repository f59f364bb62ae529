"""Jobs in flight: cascades and promotions from their launch to their outcome.

A cascade's job pins the primary slots its tier reads until the tier is done with
them. A promotion's job fills slots allocated for its keys: they become readable when
it succeeds and free when it fails. A job that times out is reported failed at once
and leaves the table; the slots its I/O may still touch go to the slot ledger's
``io`` holder, which frees them only once that I/O has stopped. This module is the only
one that changes the in-flight counts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from kvtier.keys import OffloadKey
from kvtier.metrics import Names
from kvtier.tiering.ledger import Holder
from kvtier.tiers.base import TransferJob

if TYPE_CHECKING:
    from kvtier.tiering.completions import JobOutcome
    from kvtier.tiering.core import TieringCore

__all__ = ["CascadeListener", "InFlight", "JobTable", "PromotionEnded"]

_N = TypeVar("_N", int, float)


class CascadeListener(Protocol):
    """Hears where cascades go: a host that must know when a chunk has a copy in a
    tier (see :meth:`~kvtier.tiering.host.HostAccess.listen_to_cascades`). Called under
    the manager's lock: record and return. A cascade back-pressure drops is never
    started, so it is never heard of."""

    def cascade_started(self, tier: int, keys: Sequence[OffloadKey]) -> None:
        """A cascade of ``keys`` to the tier at index ``tier`` is on its way."""

    def cascade_ended(self, tier: int, keys: Sequence[OffloadKey], stored: bool) -> None:
        """That cascade ended: ``stored`` says whether the tier reported the keys stored
        (a failure or a time-out is not)."""


class InFlight:
    """One tier's jobs in flight, and the chunks they move."""

    __slots__ = ("cascade_chunks", "cascades", "promotion_chunks", "promotions")

    def __init__(self) -> None:
        self.cascades = 0
        self.promotions = 0
        #: Chunks the tier is reading out of primary slots (cascades).
        self.cascade_chunks = 0
        #: Chunks the tier is writing into primary slots (promotions).
        self.promotion_chunks = 0


@dataclass(frozen=True, slots=True)
class PromotionEnded:
    """What a promotion job's outcome did."""

    tier: int
    req_id: str
    #: Keys now readable.
    loaded: list[OffloadKey]
    #: Keys the tier could not deliver (their slots are free, or kept for late I/O).
    failed: list[OffloadKey]
    #: Seconds from the job's start on its tier to its outcome.
    job_time: float


@dataclass(slots=True)
class _Job:
    tier: int
    job: TransferJob
    #: When the job was asked for (a promotion: the hit that queued its first key).
    since: float
    #: When the job went to its tier (a promotion may wait for a free job before).
    launched: float


class JobTable:
    """Every job in flight, and what its outcome does to the primary tier."""

    def __init__(self, core: TieringCore) -> None:
        self._primary = core.primary
        self._ledger = core.ledger
        self._chunk_bytes = core.chunk_bytes
        self._tiers = core.tiers
        self.in_flight = [InFlight() for _ in core.tiers]
        self._jobs: dict[int, _Job] = {}
        #: Jobs that timed out and whose coroutine has not returned yet.
        self.late: set[int] = set()
        self.cascade_listeners: list[CascadeListener] = []
        self._next_id = 0

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def late_ended(self, job_id: int) -> None:
        """The coroutine of a job that timed out has returned."""
        self.late.discard(job_id)

    def cascade(
        self, tier: int, keys: Sequence[OffloadKey], req_id: str, now: float
    ) -> TransferJob | None:
        """A store job of readable ``keys`` to a tier (pinned for the job), unless
        back-pressure drops it."""
        backpressure = self._tiers[tier].backpressure
        if backpressure is not None and not backpressure.admit(len(keys)):
            return None
        job_id = self._new_id()
        slots = self._ledger.pin(keys, Holder.job(job_id))
        job = TransferJob(job_id, tuple(keys), tuple(slots), False, req_id)
        self._jobs[job_id] = _Job(tier, job, now, now)
        counts = self.in_flight[tier]
        counts.cascades += 1
        counts.cascade_chunks += len(keys)
        for listener in self.cascade_listeners:
            listener.cascade_started(tier, job.keys)
        return job

    def promotion(
        self,
        tier: int,
        keys: Sequence[OffloadKey],
        slots: Sequence[int],
        req_id: str,
        since: float,
        now: float,
    ) -> TransferJob:
        """A load job filling ``slots`` (allocated for ``keys``) from a tier."""
        job = TransferJob(self._new_id(), tuple(keys), tuple(slots), True, req_id)
        self._jobs[job.job_id] = _Job(tier, job, since, now)
        counts = self.in_flight[tier]
        counts.promotions += 1
        counts.promotion_chunks += len(keys)
        return job

    def finished(self, outcome: JobOutcome) -> PromotionEnded | None:
        """Apply a job's outcome; for a promotion, what it loaded and what it did not."""
        entry = self._jobs.pop(outcome.job.job_id, None)
        if entry is None:
            return None
        job = outcome.job
        if not outcome.released:
            self.late.add(job.job_id)
        counts = self.in_flight[entry.tier]
        if job.is_promotion:
            counts.promotions -= 1
            counts.promotion_chunks -= len(job.keys)
            return self._promotion_finished(entry, outcome)
        counts.cascades -= 1
        counts.cascade_chunks -= len(job.keys)
        self._cascade_finished(entry, outcome)
        return None

    def _promotion_finished(self, entry: _Job, outcome: JobOutcome) -> PromotionEnded:
        job, result = outcome.job, outcome.result
        if not outcome.released:
            # Timed out: the keys are misses now; their slots wait for the I/O to stop.
            self._ledger.io_gave_up(job.job_id, job.keys)
            loaded, failed = [], list(job.keys)
        elif result.success and result.successful_keys is None:
            loaded, failed = list(job.keys), []
        else:
            succeeded = set(result.successful_keys or ())
            loaded = [key for key in job.keys if key in succeeded]
            failed = [key for key in job.keys if key not in succeeded]
        if outcome.released:
            self._primary.complete_write(loaded, True)
            self._primary.complete_write(failed, False)
        counts = self._tiers[entry.tier].counts
        if not result.success:
            counts.counters[Names.PROMOTION_JOB_FAILURES] += 1
        if loaded:
            measured = len(loaded) * self._chunk_bytes
            counts.counters[Names.READ_BYTES] += _or(result.transfer_bytes, measured)
            counts.counters[Names.READ_TIME] += _or(result.transfer_time, outcome.elapsed)
            now = time.perf_counter()
            counts.samples[Names.PROMOTION_LATENCY].append(now - entry.since)
            counts.samples[Names.PROMOTION_JOB_TIME].append(now - entry.launched)
        job_time = time.perf_counter() - entry.launched
        return PromotionEnded(entry.tier, job.req_id, loaded, failed, job_time)

    def _cascade_finished(self, entry: _Job, outcome: JobOutcome) -> None:
        job, result = outcome.job, outcome.result
        if outcome.released:
            self._ledger.release_all(Holder.job(job.job_id))
        else:
            # Timed out: the tier may still read the slots; they stay pinned for its I/O.
            self._ledger.io_gave_up(job.job_id, ())
        nbytes = _or(result.transfer_bytes, len(job.keys) * self._chunk_bytes)
        state = self._tiers[entry.tier]
        counts = state.counts
        if result.success:
            counts.counters[Names.WRITE_BYTES] += nbytes
            counts.counters[Names.WRITE_TIME] += _or(result.transfer_time, outcome.elapsed)
        else:
            counts.counters[Names.CASCADE_JOB_FAILURES] += 1
        backpressure = state.backpressure
        if backpressure is not None:
            backpressure.record(outcome.elapsed, nbytes, failed=not result.success)
        for listener in self.cascade_listeners:
            listener.cascade_ended(entry.tier, job.keys, result.success)

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id


def _or(reported: _N | None, measured: _N) -> _N:
    """A tier's own figure when it gave one (0 included), else the framework's."""
    return measured if reported is None else reported
