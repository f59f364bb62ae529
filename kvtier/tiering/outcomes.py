"""The records that travel from the tier side to the manager.

Tier coroutines never touch manager state: whatever they have to say goes into the
manager's completion queue as one of these records, and the manager applies them
under its lock (see :class:`~kvtier.tiering.completions.CompletionQueue`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Union

from kvtier.keys import OffloadKey
from kvtier.tiering.ledger import Holder
from kvtier.tiers.base import JobResult, TransferJob

__all__ = [
    "JobOutcome",
    "JobReleased",
    "LookupOutcome",
    "Outcome",
    "PinRequest",
    "SettleSlots",
    "UnpinRequest",
]


@dataclass(frozen=True, slots=True)
class LookupOutcome:
    """A batch of async lookups ended."""

    runner: int
    keys: tuple[OffloadKey, ...]
    #: One answer per key, or None when the lookup failed or timed out.
    answers: tuple[bool, ...] | None
    elapsed: float


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """A store or load job ended, or timed out."""

    runner: int
    job: TransferJob
    result: JobResult
    #: Seconds from submission (queueing included) to the outcome.
    elapsed: float
    #: False when the job timed out and the tier may still use its slots.
    released: bool


@dataclass(frozen=True, slots=True)
class JobReleased:
    """The coroutine of a job that timed out has returned (a late completion)."""

    runner: int
    job: TransferJob


@dataclass(frozen=True, slots=True)
class SettleSlots:
    """Time to look again whether late I/O still touches the slots kept for it."""


@dataclass(frozen=True, slots=True)
class PinRequest:
    """A tier asks to pin readable primary slots by key (pinned reads, p2p)."""

    holder: Holder
    keys: tuple[OffloadKey, ...]
    future: asyncio.Future[dict[OffloadKey, memoryview]]


@dataclass(frozen=True, slots=True)
class UnpinRequest:
    """A tier releases pins a :class:`PinRequest` took."""

    holder: Holder
    keys: tuple[OffloadKey, ...]


Outcome = Union[  # noqa: UP007 - a runtime alias on Python 3.10
    LookupOutcome, JobOutcome, JobReleased, PinRequest, UnpinRequest, SettleSlots
]
