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

import anyio

from kvtier._logs import ThrottledLog, describe_failure
from kvtier.keys import OffloadKey
from kvtier.resources import AsyncResource, TaskSet
from kvtier.tiering.completions import JobOutcome, JobReleased, LookupOutcome, Outcome
from kvtier.tiers.base import JobResult, SecondaryTier, TransferJob

__all__ = ["RunnerSettings", "TierRunner", "start_in_order"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True)
class RunnerSettings:
    #: Jobs of this tier running at once; further jobs wait their turn.
    max_concurrent_jobs: int = 8
    #: Promotion jobs of this tier start while fewer chunks than this are being promoted
    #: (one job may always start); the others wait in the manager, their slots
    #: allocated, request by request in the order each first hit. None: no limit but
    #: ``max_concurrent_jobs``.
    max_promotion_chunks: int | None = None
    #: A job still running after this long is reported failed (a miss).
    job_timeout_s: float = 30.0
    #: A batch of lookups still running after this long answers "not present".
    lookup_timeout_s: float = 5.0
    #: At shutdown, coroutines still running this long after their own timeout are
    #: cancelled and left behind, so a tier that never returns cannot hang shutdown.
    shutdown_grace_s: float = 5.0


class TierRunner(AsyncResource):
    """The framework side of one tier: it starts, runs and drains its coroutines."""

    def __init__(
        self,
        index: int,
        tier: SecondaryTier,
        settings: RunnerSettings,
        post: Callable[[Outcome], None],
    ) -> None:
        self.index = index
        self.tier = tier
        self.label = tier.ctx.tier_name
        self.settings = settings
        self._post = post
        # The runner reports every failure itself, once, through _failures.
        self._tasks = TaskSet(f"tier {self.label}", log_failures=False)
        # Neither binds to a loop before its first use (Python >= 3.10).
        self._job_slots = asyncio.Semaphore(settings.max_concurrent_jobs)
        self._ready = asyncio.Event()
        self._broken = False
        self._started = False
        self._closed = False
        self._failures = ThrottledLog(logger, f"tier {self.label}")

    async def start(self) -> None:
        try:
            await self.tier.start()
        except BaseException:
            self.abandon()
            raise
        self._started = True
        self._ready.set()

    def abandon(self) -> None:
        """The tier will never run: fail whatever is waiting for it instead of hanging."""
        self._broken = True
        self._ready.set()

    # The launch methods run on the loop thread.

    def launch_job(self, job: TransferJob, submitted: float) -> None:
        self._tasks.spawn(self._run_job(job, submitted))

    def launch_lookup(self, keys: tuple[OffloadKey, ...]) -> None:
        self._tasks.spawn(self._run_lookup(keys))

    @property
    def busy(self) -> bool:
        return bool(self._tasks)

    async def aclose(self) -> None:
        """Drain, giving up on coroutines that outlive every timeout, then close the tier.

        A tier that never started (or failed to) is not closed: it holds nothing.
        """
        if self._closed:
            return
        self._closed = True
        settings = self.settings
        limit = max(settings.job_timeout_s, settings.lookup_timeout_s) + settings.shutdown_grace_s
        if not await self._tasks.wait(limit):
            logger.error(
                "tier %s: %d coroutine(s) still running at shutdown; cancelling them",
                self.label,
                len(self._tasks),
            )
            await self._tasks.aclose(settings.shutdown_grace_s)
        if not self._started:
            return
        try:
            await self.tier.aclose()
        except Exception as exc:
            logger.error("tier %s failed to close: %s", self.label, describe_failure(exc))

    async def _run_job(self, job: TransferJob, submitted: float) -> None:
        kind = "promotion" if job.is_promotion else "cascade"
        await self._ready.wait()
        if self._broken:
            failed = JobResult(job.job_id, False)
            elapsed = time.perf_counter() - submitted
            self._post(JobOutcome(self.index, job, failed, elapsed, released=True))
            return
        async with self._job_slots:
            operation = self.tier.load if job.is_promotion else self.tier.store
            finished, outcome, inner, scope = await self._bounded(
                self._call(operation, job, kind), self.settings.job_timeout_s
            )
            elapsed = time.perf_counter() - submitted
            if finished:
                assert outcome is not None
                self._post(JobOutcome(self.index, job, outcome, elapsed, released=True))
                return
            self._failures.warning(
                f"{kind} timeout",
                "%s job %d (%d chunks) timed out after %g s",
                kind,
                job.job_id,
                len(job.keys),
                self.settings.job_timeout_s,
            )
            failed = JobResult(job.job_id, False)
            self._post(JobOutcome(self.index, job, failed, elapsed, released=False))
            scope.cancel()
            # Hold the concurrency slot and the primary slots until the tier has let go:
            # through anyio's cancellation, a call in anyio.to_thread.run_sync returns
            # before the coroutine ends.
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
            self._failures.warning(
                f"{kind} failure",
                "%s job %d (%d chunks) failed",
                kind,
                job.job_id,
                len(job.keys),
                error=exc,
            )
            return JobResult(job.job_id, False)
        if not isinstance(result, JobResult) or result.job_id != job.job_id:
            self._failures.warning(
                f"{kind} result", "%s job %d returned %r", kind, job.job_id, result
            )
            return JobResult(job.job_id, False)
        return result

    async def _run_lookup(self, keys: tuple[OffloadKey, ...]) -> None:
        await self._ready.wait()
        if self._broken:
            self._post(LookupOutcome(self.index, keys, None, 0.0))
            return
        started = time.perf_counter()
        finished, answers, _, _ = await self._bounded(
            self._ask(keys), self.settings.lookup_timeout_s
        )
        if not finished:
            self._failures.warning(
                "lookup timeout",
                "lookup of %d chunks timed out after %g s",
                len(keys),
                self.settings.lookup_timeout_s,
            )
        self._post(LookupOutcome(self.index, keys, answers, time.perf_counter() - started))

    async def _ask(self, keys: Sequence[OffloadKey]) -> tuple[bool, ...] | None:
        try:
            answers = tuple(bool(a) for a in await self.tier.lookup(keys))
        except Exception as exc:
            self._failures.warning(
                "lookup failure", "lookup of %d chunks failed", len(keys), error=exc
            )
            return None
        if len(answers) != len(keys):
            self._failures.warning(
                "lookup result",
                "lookup of %d chunks returned %d answers",
                len(keys),
                len(answers),
            )
            return None
        return answers

    async def clear(self) -> bool:
        """Ask the tier to drop every chunk it holds, within the job timeout; whether
        it did (a tier that cannot, fails or runs out of time did not)."""
        await self._ready.wait()
        if self._broken:
            return False
        limit = self.settings.job_timeout_s
        finished, cleared, _, _ = await self._bounded(self._clear(), limit)
        if not finished:
            self._failures.warning("clear timeout", "clearing timed out after %g s", limit)
        return bool(cleared)

    async def _clear(self) -> bool:
        try:
            return bool(await self.tier.clear())
        except Exception as exc:
            self._failures.warning("clear failure", "clearing failed", error=exc)
            return False

    async def _bounded(
        self, coro: Coroutine[Any, Any, _T], limit_s: float
    ) -> tuple[bool, _T | None, asyncio.Task[_T | None], anyio.CancelScope]:
        """Run ``coro`` for at most ``limit_s``; a late one keeps running, owned here.

        The coroutine runs in a cancel scope of its own, for the caller to cancel.
        """
        scope = anyio.CancelScope()

        async def scoped() -> _T | None:
            with scope:
                return await coro
            return None  # cancelled through the scope

        inner = self._tasks.spawn(scoped())
        done, _ = await asyncio.wait({inner}, timeout=limit_s)
        if inner in done:
            return True, inner.result(), inner, scope
        return False, None, inner, scope


async def start_in_order(runners: Sequence[TierRunner]) -> None:
    """Start every tier in order; if one fails, close those before it and re-raise.

    Whatever waits for a tier that will never start is failed rather than left hanging.
    """
    started: list[TierRunner] = []
    try:
        for runner in runners:
            await runner.start()
            started.append(runner)
    except BaseException:
        logger.error(
            "tier %s failed to start; closing the tiers started before it",
            runners[len(started)].label,
        )
        for runner in runners:
            runner.abandon()
        for runner in reversed(started):
            await runner.aclose()
        raise
