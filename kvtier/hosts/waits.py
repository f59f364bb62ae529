"""Step until what a host waits for holds, or its deadline passes.

Every host waits the same way for tier work (a promotion, an answer from a tier, a
cascade freeing slots): it reads the manager's completion mark, takes a step (looks
keys up, tries to store, ends a scheduler step), and if what it waits for does not hold
yet, waits for a completion after that mark. A completion between the step and the
wait then ends the wait at once instead of being missed, and no host ever polls.

Two things change without a completion, so the wait is bounded by them too: the
request's own deadline in the manager (``pending_remaining_s``: its pending chunks turn
into misses then) and whatever the host says changes on a clock of its own
(``recheck``: a lease running out, worker-thread copies a scheduler loop collects).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from kvtier.hosts.fence import Fence
from kvtier.records import ReqContext

__all__ = ["Completions", "Step", "step_until", "step_until_blocking"]

#: The fence of hosts that have none: never raised, its waits end by time or completion.
_NEVER_RAISED = Fence()


class Completions(Protocol):
    """What the waits need of the manager (``manager.host``)."""

    @property
    def completion_mark(self) -> int: ...

    def wait_for_completions(self, since: int | None = None) -> Coroutine[Any, Any, None]: ...

    def wait_for_completions_blocking(
        self, timeout: float | None = None, since: int | None = None
    ) -> None: ...

    def pending_remaining_s(self, req: ReqContext) -> float | None: ...


class Step(enum.Enum):
    """What a host's step found."""

    #: What the host waits for holds, or never will: stop.
    DONE = "done"
    #: The step moved something: take the next one at once.
    AGAIN = "again"
    #: Nothing to do until something completes: wait for a completion, then step.
    WAIT = "wait"


async def step_until(
    host: Completions,
    step: Callable[[], Step],
    *,
    deadline: float | None = None,
    req: ReqContext | None = None,
    recheck: Callable[[], float | None] | None = None,
    fence: Fence | None = None,
) -> bool:
    """Call ``step`` until it says :attr:`Step.DONE`; between steps that say
    :attr:`Step.WAIT`, wait (without blocking the loop) for a completion after the mark
    read before the step.

    A step should make a scheduler call (a lookup, ``prepare_store``,
    ``on_schedule_end``): those apply the outcomes the tiers posted first. A step that
    makes none still sees each outcome: the tier loop applies it soon after it is
    posted and then notifies, which ends the wait.

    Args:
        deadline: ``time.monotonic()`` after which the host stops waiting (None: never).
        req: the request whose pending chunks the steps wait for: the wait also ends
            at the manager's deadline for them.
        recheck: seconds after which the next step is due even without a completion
            (None: only after one).
        fence: while it stands, stop: raising it interrupts the wait.

    Returns:
        True once ``step`` said DONE; False when the deadline (the host's or the
        request's) passed or the fence went up first.
    """
    while True:
        mark = host.completion_mark
        found = step()
        if found is Step.DONE:
            return True
        if fence is not None and fence.raised:
            return False
        if found is Step.AGAIN:
            await asyncio.sleep(0)  # let the loop run between steps that keep moving
            continue
        bound = _bound(host, deadline, req)
        until = _wake_at(bound, recheck)
        await (fence or _NEVER_RAISED).wait_unless_raised(host.wait_for_completions(mark), until)
        if fence is not None and fence.raised:
            return False
        if bound is not None and time.monotonic() >= bound:
            return False


def step_until_blocking(
    host: Completions,
    step: Callable[[], Step],
    *,
    deadline: float | None = None,
    req: ReqContext | None = None,
    recheck: Callable[[], float | None] | None = None,
) -> bool:
    """:func:`step_until` for a thread: the waits block it. No fence: a thread's wait
    ends by a completion, the deadline or ``recheck``."""
    while True:
        mark = host.completion_mark
        found = step()
        if found is Step.DONE:
            return True
        if found is Step.AGAIN:
            continue
        bound = _bound(host, deadline, req)
        until = _wake_at(bound, recheck)
        timeout = None if until is None else until - time.monotonic()
        if timeout is None or timeout > 0:
            host.wait_for_completions_blocking(timeout, since=mark)
        if bound is not None and time.monotonic() >= bound:
            return False


def _bound(host: Completions, deadline: float | None, req: ReqContext | None) -> float | None:
    """The earlier of the host's deadline and the manager's for the request."""
    remaining = None if req is None else host.pending_remaining_s(req)
    if remaining is None:
        return deadline
    ends = time.monotonic() + remaining
    return ends if deadline is None else min(deadline, ends)


def _wake_at(bound: float | None, recheck: Callable[[], float | None] | None) -> float | None:
    after = None if recheck is None else recheck()
    if after is None:
        return bound
    due = time.monotonic() + after
    return due if bound is None else min(bound, due)
