"""Jobs in flight: cascades and promotions from their launch to the release of their slots.

A cascade pins the primary slots it reads until its tier is done with them. A
promotion owns the slots it writes: they become readable when it succeeds and free
when it fails. A job that timed out is reported failed at once, but its slots stay
out of use (quarantined) until the tier's coroutine has really stopped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvtier.keys import OffloadKey
from kvtier.metrics import Names
from kvtier.primary import PrimaryTier
from kvtier.tiering.lookups import TierState
from kvtier.tiering.outcomes import JobOutcome, JobReleased
from kvtier.tiers.base import TransferJob

__all__ = ["JobTable"]

_N = TypeVar("_N", int, float)


@dataclass(slots=True)
class _Job:
    state: TierState
    job: TransferJob
    since: float
    #: When the job went to its tier (a promotion may wait for a free job before).
    launched: float = 0.0
    #: Slots of a timed-out promotion, held until its I/O has stopped.
    quarantined: list[int] = field(default_factory=list)


class JobTable:
    """Every job in flight, and what its outcome does to the primary tier."""

    def __init__(self, primary: PrimaryTier, chunk_bytes: int) -> None:
        self._primary = primary
        self._chunk_bytes = chunk_bytes
        self._jobs: dict[int, _Job] = {}
        self._next_id = 0

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def cascade(
        self, state: TierState, keys: Sequence[OffloadKey], req_id: str, now: float
    ) -> TransferJob | None:
        """A store job of readable ``keys`` to one tier (pinned), unless back-pressure drops it."""
        if state.backpressure is not None and not state.backpressure.admit(len(keys)):
            return None
        spec = self._primary.prepare_read(keys)
        job = TransferJob(self._new_id(), tuple(keys), tuple(spec.chunk_ids), False, req_id)
        self._jobs[job.job_id] = _Job(state, job, now)
        state.active_cascades += 1
        state.read_chunks += len(keys)
        return job

    def promotions(self, state: TierState, now: float) -> list[TransferJob]:
        """One load job per request whose promotions from ``state`` may start now."""
        jobs: list[TransferJob] = []
        for req_id, promotion in state.take_promotions():
            job = TransferJob(
                self._new_id(), tuple(promotion.keys), tuple(promotion.slots), True, req_id
            )
            self._jobs[job.job_id] = _Job(state, job, promotion.since, launched=now)
            state.active_promotions += 1
            state.write_chunks += len(job.keys)
            jobs.append(job)
        return jobs

    def finished(self, outcome: JobOutcome) -> list[OffloadKey] | None:
        """Apply a job's outcome; for a promotion, the keys it made readable."""
        entry = self._jobs.get(outcome.job.job_id)
        if entry is None:
            return None
        if outcome.job.is_promotion:
            return self._promotion_finished(entry, outcome)
        self._cascade_finished(entry, outcome)
        return None

    def released(self, released: JobReleased) -> None:
        """A timed-out job's coroutine stopped: its slots go back."""
        entry = self._jobs.pop(released.job.job_id, None)
        if entry is None:
            return
        state, job = entry.state, released.job
        if job.is_promotion:
            state.active_promotions -= 1
            state.write_chunks -= len(job.keys)
            self._primary.free_slots(entry.quarantined)
        else:
            state.active_cascades -= 1
            state.read_chunks -= len(job.keys)
            self._primary.complete_read(job.keys)

    def _promotion_finished(self, entry: _Job, outcome: JobOutcome) -> list[OffloadKey]:
        state, job, result = entry.state, outcome.job, outcome.result
        if outcome.released and result.success and result.successful_keys is None:
            loaded, failed = list(job.keys), []
        else:
            succeeded = set(result.successful_keys or ()) if outcome.released else set()
            loaded = [key for key in job.keys if key in succeeded]
            failed = [key for key in job.keys if key not in succeeded]
        if outcome.released:
            del self._jobs[job.job_id]
            state.active_promotions -= 1
            state.write_chunks -= len(job.keys)
            self._primary.complete_write(loaded, True)
            self._primary.complete_write(failed, False)
        else:
            entry.quarantined = self._primary.detach(job.keys)
        if failed:
            state.forget_hits(failed, job.req_id)
        counts = state.counts
        if not result.success:
            counts.counters[Names.PROMOTION_JOB_FAILURES] += 1
        if loaded:
            measured = len(loaded) * self._chunk_bytes
            counts.counters[Names.READ_BYTES] += _or(result.transfer_bytes, measured)
            counts.counters[Names.READ_TIME] += _or(result.transfer_time, outcome.elapsed)
            now = time.perf_counter()
            counts.samples[Names.PROMOTION_LATENCY].append(now - entry.since)
            counts.samples[Names.PROMOTION_JOB_TIME].append(now - entry.launched)
        return loaded

    def _cascade_finished(self, entry: _Job, outcome: JobOutcome) -> None:
        state, job, result = entry.state, outcome.job, outcome.result
        if outcome.released:
            del self._jobs[job.job_id]
            state.active_cascades -= 1
            state.read_chunks -= len(job.keys)
            self._primary.complete_read(job.keys)
        nbytes = _or(result.transfer_bytes, len(job.keys) * self._chunk_bytes)
        counts = state.counts
        if result.success:
            counts.counters[Names.WRITE_BYTES] += nbytes
            counts.counters[Names.WRITE_TIME] += _or(result.transfer_time, outcome.elapsed)
        else:
            counts.counters[Names.CASCADE_JOB_FAILURES] += 1
        if state.backpressure is not None:
            state.backpressure.record(outcome.elapsed, nbytes, failed=not result.success)

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id


def _or(reported: _N | None, measured: _N) -> _N:
    """A tier's own figure when it gave one (0 included), else the framework's."""
    return measured if reported is None else reported
