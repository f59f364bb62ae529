"""Running one tier's coroutines: tasks, limits, timeouts, failures.

A :class:`TierRunner` is the framework around one :class:`~kvtier.tiers.SecondaryTier`.
It runs on the tier event loop and never touches manager state: every outcome goes to
the manager's completion queue through ``post``.

A job that outlives its timeout is reported failed at once, so the scheduler never
waits on a stuck disk or server, but its slots are only given back (``JobReleased``)
when the tier's coroutine has really stopped: a thread still writing into a slot must
never race with a new owner of that slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtier.keys import OffloadKey
from kvtier.tiers.base import JobResult, SecondaryTier, TransferJob

__all__ = ["JobOutcome", "JobReleased", "LookupOutcome", "RunnerSettings", "TierRunner"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Failures are logged once with context, then summarised at most this often, so a dead
# server produces one line every few seconds rather than one per job.
_FAILURE_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class RunnerSettings:
    #: Jobs of this tier running at once; further jobs wait their turn.
    max_concurrent_jobs: int = 8
    #: A job still running after this long is reported failed (a miss).
    job_timeout_s: float = 30.0
    #: A batch of lookups still running after this long answers "not present".
    lookup_timeout_s: float = 5.0
    #: At shutdown, coroutines still running this long after their own timeout are
    #: cancelled and left behind, so a tier that never returns cannot hang shutdown.
    shutdown_grace_s: float = 5.0


@dataclass(frozen=True)
class LookupOutcome:
    runner: int
    keys: tuple[OffloadKey, ...]
    #: One answer per key, or None when the lookup failed or timed out.
    answers: tuple[bool, ...] | None
    elapsed: float


@dataclass(frozen=True)
class JobOutcome:
    runner: int
    job: TransferJob
    result: JobResult
    #: Seconds from submission (queueing included) to the outcome.
    elapsed: float
    #: False when the job timed out and the tier still holds its slots.
    released: bool


@dataclass(frozen=True)
class JobReleased:
    """A timed-out job's coroutine has stopped: its slots are free to reuse."""

    runner: int
    job: TransferJob


class _FailureLog:
    def __init__(self, label: str) -> None:
        self._label = label
        self._suppressed = 0
        self._last = -_FAILURE_LOG_INTERVAL_S

    def report(self, what: str, exc: BaseException | None) -> None:
        now = time.monotonic()
        if now - self._last < _FAILURE_LOG_INTERVAL_S:
            self._suppressed += 1
            return
        more = (
            f" ({self._suppressed} more failures since the last report)" if self._suppressed else ""
        )
        logger.warning("tier %s: %s%s", self._label, what, more, exc_info=exc)
        self._suppressed = 0
        self._last = now


class TierRunner:
    """The framework side of one tier: it starts, runs and drains its coroutines."""

    def __init__(
        self,
        index: int,
        tier: SecondaryTier,
        settings: RunnerSettings,
        post: Callable[[object], None],
    ) -> None:
        self.index = index
        self.tier = tier
        self.label = tier.ctx.tier_name
        self.settings = settings
        self._post = post
        self._tasks: set[asyncio.Future[Any]] = set()
        # Neither binds to a loop before its first use (Python >= 3.10).
        self._slots = asyncio.Semaphore(settings.max_concurrent_jobs)
        self._ready = asyncio.Event()
        self._broken = False
        self._failures = _FailureLog(self.label)

    async def start(self) -> None:
        try:
            await self.tier.start()
        except BaseException:
            self.abandon()
            raise
        self._ready.set()

    def abandon(self) -> None:
        """The tier will never run: fail whatever is waiting for it instead of hanging."""
        self._broken = True
        self._ready.set()

    # The launch methods run on the loop thread.

    def launch_job(self, job: TransferJob, submitted: float) -> None:
        self._own(asyncio.ensure_future(self._run_job(job, submitted)))

    def launch_lookup(self, keys: tuple[OffloadKey, ...]) -> None:
        self._own(asyncio.ensure_future(self._run_lookup(keys)))

    @property
    def busy(self) -> bool:
        return bool(self._tasks)

    async def drain(self) -> None:
        """Wait until every coroutine this runner started has finished."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    async def close(self) -> None:
        """Drain, giving up on coroutines that outlive every timeout, then close the tier."""
        settings = self.settings
        limit = max(settings.job_timeout_s, settings.lookup_timeout_s) + settings.shutdown_grace_s
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=limit)
        if self._tasks:
            stuck = list(self._tasks)
            logger.error(
                "tier %s: %d coroutine(s) still running at shutdown; cancelling them",
                self.label,
                len(stuck),
            )
            for task in stuck:
                task.cancel()
            await asyncio.wait(stuck, timeout=settings.shutdown_grace_s)
        await self.tier.aclose()

    def _own(self, task: asyncio.Future[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_job(self, job: TransferJob, submitted: float) -> None:
        kind = "promotion" if job.is_promotion else "cascade"
        await self._ready.wait()
        if self._broken:
            failed = JobResult(job.job_id, False)
            elapsed = time.perf_counter() - submitted
            self._post(JobOutcome(self.index, job, failed, elapsed, released=True))
            return
        async with self._slots:
            operation = self.tier.load if job.is_promotion else self.tier.store
            finished, outcome, inner = await self._bounded(
                self._call(operation, job, kind), self.settings.job_timeout_s
            )
            elapsed = time.perf_counter() - submitted
            if finished:
                assert outcome is not None
                self._post(JobOutcome(self.index, job, outcome, elapsed, released=True))
                return
            self._failures.report(
                f"{kind} job {job.job_id} ({len(job.keys)} chunks) timed out after "
                f"{self.settings.job_timeout_s:g} s",
                None,
            )
            failed = JobResult(job.job_id, False)
            self._post(JobOutcome(self.index, job, failed, elapsed, released=False))
            inner.cancel()
            # Hold the concurrency slot and the primary slots until the tier has let go.
            await asyncio.wait({inner})
            self._post(JobReleased(self.index, job))

    async def _call(
        self,
        operation: Callable[[TransferJob], Coroutine[Any, Any, JobResult]],
        job: TransferJob,
        kind: str,
    ) -> JobResult:
        try:
            result = await operation(job)
        except Exception as exc:
            self._failures.report(f"{kind} job {job.job_id} ({len(job.keys)} chunks) failed", exc)
            return JobResult(job.job_id, False)
        if not isinstance(result, JobResult) or result.job_id != job.job_id:
            self._failures.report(f"{kind} job {job.job_id} returned {result!r}", None)
            return JobResult(job.job_id, False)
        return result

    async def _run_lookup(self, keys: tuple[OffloadKey, ...]) -> None:
        await self._ready.wait()
        if self._broken:
            self._post(LookupOutcome(self.index, keys, None, 0.0))
            return
        started = time.perf_counter()
        finished, answers, _ = await self._bounded(self._ask(keys), self.settings.lookup_timeout_s)
        if not finished:
            timeout = self.settings.lookup_timeout_s
            self._failures.report(
                f"lookup of {len(keys)} chunks timed out after {timeout:g} s", None
            )
        self._post(LookupOutcome(self.index, keys, answers, time.perf_counter() - started))

    async def _ask(self, keys: Sequence[OffloadKey]) -> tuple[bool, ...] | None:
        try:
            answers = tuple(bool(a) for a in await self.tier.lookup(keys))
        except Exception as exc:
            self._failures.report(f"lookup of {len(keys)} chunks failed", exc)
            return None
        if len(answers) != len(keys):
            self._failures.report(
                f"lookup of {len(keys)} chunks returned {len(answers)} answers", None
            )
            return None
        return answers

    async def _bounded(
        self, coro: Coroutine[Any, Any, _T], timeout: float
    ) -> tuple[bool, _T | None, asyncio.Future[_T]]:
        """Run ``coro`` for at most ``timeout`` s; a late one keeps running, owned here."""
        inner = asyncio.ensure_future(coro)
        self._own(inner)
        done, _ = await asyncio.wait({inner}, timeout=timeout)
        if inner in done:
            return True, inner.result(), inner
        return False, None, inner
