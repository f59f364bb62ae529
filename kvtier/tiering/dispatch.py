"""Work to the tier loop and outcomes back: the one path between the two.

The manager decides (which key is promoted, which slots a job gets); the
:class:`Dispatcher` carries the decisions out. It hands jobs and lookup batches to the
tier loop, cascades and promotions alike, in one call per step, and applies what
comes back through the completion queue: a job's outcome to the job table, the slot
ledger, the lookup answers and the tier's measured promotion cost; a lookup batch to
its tier's answers; a late job's end and pin requests to the ledger. Everything here
runs under the manager's lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvtier.keys import OffloadKey
from kvtier.metrics import Names
from kvtier.tiering.admission import Deadlines, PromotionCosts
from kvtier.tiering.completions import CompletionQueue
from kvtier.tiering.jobs import JobTable
from kvtier.tiering.ledger import Holder, SlotLedger
from kvtier.tiering.loop import TierLoop
from kvtier.tiering.outcomes import (
    JobOutcome,
    JobReleased,
    LookupOutcome,
    Outcome,
    PinRequest,
    SettleSlots,
    UnpinRequest,
)
from kvtier.tiering.pins import PinService
from kvtier.tiering.promotions import Promotions
from kvtier.tiering.requests import RequestTable
from kvtier.tiering.runner import TierRunner
from kvtier.tiering.state import TierState
from kvtier.tiers.base import TransferJob

__all__ = ["Dispatcher"]

# How often the manager looks again whether late I/O still touches the slots kept for
# it. Only slots of jobs that timed out wait for this; such a slot is reused at most
# this long after its last user let go.
_SETTLE_INTERVAL_S = 0.05

_Lookups = Sequence[tuple[int, tuple[OffloadKey, ...]]]


class Dispatcher:
    """Sends the manager's work to the tier loop and applies what comes back."""

    def __init__(
        self,
        loop: TierLoop | None,
        tiers: Sequence[TierState],
        jobs: JobTable,
        promotions: Promotions,
        ledger: SlotLedger,
        requests: RequestTable,
        completions: CompletionQueue,
        pins: PinService | None,
        finish_request: Callable[[str], None],
        closed: Callable[[], bool],
        costs: PromotionCosts,
        deadlines: Deadlines,
    ) -> None:
        self._costs = costs
        self._deadlines = deadlines
        self._loop = loop
        self._tiers = tiers
        self._runners: list[TierRunner] = [state.runner for state in tiers]
        self._jobs = jobs
        self._promotions = promotions
        self._ledger = ledger
        self._requests = requests
        self._completions = completions
        self._pins = pins
        self._finish_request = finish_request
        self._closed = closed
        self._settling = False

    # ------------------------------------------------------------------- out

    def cascade(self, keys: list[OffloadKey], req_id: str) -> None:
        """One store job of readable ``keys`` per tier that back-pressure admits."""
        now = time.perf_counter()
        jobs = self._jobs
        self.launch(
            [
                (index, job)
                for index in range(len(self._tiers))
                if (job := jobs.cascade(index, keys, req_id, now)) is not None
            ]
        )

    def launch_step(self) -> None:
        """End of a step: its lookup batches and the promotion jobs that may start."""
        if not self._tiers or self._closed():
            return
        now = time.perf_counter()
        lookups: list[tuple[int, tuple[OffloadKey, ...]]] = []
        jobs: list[tuple[int, TransferJob]] = []
        for index, state in enumerate(self._tiers):
            batch = state.lookups.take_queued()
            if batch is not None:
                lookups.append((index, batch))
            jobs.extend((index, job) for job in self._promotions.end_step(index, now))
        self.launch(jobs, lookups)

    def launch(self, jobs: list[tuple[int, TransferJob]], lookups: _Lookups = ()) -> None:
        """Hand jobs and lookup batches to the tier loop: the one way work gets there."""
        if not jobs and not lookups:
            return
        for _, job in jobs:
            if job.is_promotion:
                self._requests.started(job.req_id)
        assert self._loop is not None
        self._loop.call(_launch_all, self._runners, jobs, lookups, time.perf_counter())

    def busy(self) -> bool:
        """Whether any job or lookup is queued or in flight (late jobs aside)."""
        return bool(self._jobs) or any(
            state.lookups.busy or self._promotions.busy(index)
            for index, state in enumerate(self._tiers)
        )

    # -------------------------------------------------------------------- in

    def drain(self) -> None:
        """Apply every outcome posted so far; start the promotions they let go."""
        promotions_ended = False
        for outcome in self._completions.drain():
            promotions_ended |= self._apply(outcome)
        if promotions_ended and not self._closed():
            self.launch(self._promotions.start_waiting(time.perf_counter()))

    def _apply(self, outcome: Outcome) -> bool:
        """Apply one outcome; whether it let a promotion job of its tier go."""
        match outcome:
            case JobOutcome():
                return self._job_ended(outcome)
            case LookupOutcome():
                self._tiers[outcome.runner].lookups.lookup_done(outcome)
            case JobReleased():
                self._jobs.late_ended(outcome.job.job_id)
                self._tiers[outcome.runner].counts.counters[Names.LATE_COMPLETIONS] += 1
                if self._ledger.io_ended(outcome.job.job_id):
                    self._settle_later()
            case SettleSlots():
                self._settling = False
                if self._ledger.settle():
                    self._settle_later()
            case PinRequest():
                assert self._pins is not None
                self._pins.serve_pin(outcome)
            case UnpinRequest():
                assert self._pins is not None
                self._pins.serve_unpin(outcome)
        return False

    def _job_ended(self, outcome: JobOutcome) -> bool:
        ended = self._jobs.finished(outcome)
        if ended is None:  # a cascade
            return False
        req_id = ended.req_id
        self._promotions.ended(ended.loaded)
        self._promotions.ended(ended.failed)
        self._costs.job_done(ended.tier, ended.job_time, len(ended.loaded) + len(ended.failed))
        if ended.failed:
            self._tiers[ended.tier].lookups.forget_hits(ended.failed, req_id)
        if ended.loaded and self._requests.live(req_id) and not self._deadlines.is_expired(req_id):
            # Kept for the request that asked until it loads them or finishes.
            self._ledger.pin(ended.loaded, Holder.reserved(req_id))
        if self._requests.ended(req_id):
            self._finish_request(req_id)
        return True

    def _settle_later(self) -> None:
        """Look again soon whether late I/O still touches the slots kept for it."""
        loop = self._loop
        if self._settling or loop is None:
            return
        self._settling = True
        loop.call(loop.loop.call_later, _SETTLE_INTERVAL_S, self._completions.post, SettleSlots())


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
