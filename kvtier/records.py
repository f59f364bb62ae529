"""Small records shared by the scheduler-facing API."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvtier.keys import OffloadKey

__all__ = [
    "EventLog",
    "HitSource",
    "LoadStoreSpec",
    "Locality",
    "LookupResult",
    "Medium",
    "OffloadingEvent",
    "PrepareStoreOutput",
    "ReqContext",
    "ScheduleEndContext",
    "TransferResult",
]


class LookupResult(enum.Enum):
    """What :meth:`TieringOffloadingManager.lookup` knows about one key."""

    #: In no tier, or no primary slot could be found to promote it into.
    MISS = "miss"
    #: Readable in the primary tier now.
    HIT = "hit"
    #: Will be readable in the primary tier once a store or promotion completes.
    HIT_PENDING = "hit_pending"
    #: A tier has not answered yet; ask again after the next step.
    RETRY = "retry"


class Medium(enum.Enum):
    """Where a tier keeps its bytes."""

    GPU = "GPU"
    #: This engine's CPU memory (the primary tier).
    CPU = "CPU"
    #: A disk, local or shared, or an object store.
    STORAGE = "STORAGE"
    #: Other engines' memory, reached over the network.
    NETWORK = "NETWORK"
    #: A memory server outside the engines (memcached, Redis, Valkey).
    REMOTE_MEMORY = "REMOTE_MEMORY"


class Locality(str, enum.Enum):
    """Whether a tier is on this node or across a network: it picks the tier's default
    back-pressure water marks and promotion budget, and what the vLLM adapter reports.
    A ``str`` enum, so that configuration and plugins may name it as a plain string."""

    LOCAL = "local"
    REMOTE = "remote"

    def __str__(self) -> str:
        return self.value


class HitSource(enum.Enum):
    """Where a host is told a chunk loaded from a tier came from.

    A tier declares it (``SecondaryTier.hit_source``); by default it follows the
    tier's :class:`Medium`. The values are those of vLLM's ``CacheHitSource``, which
    the vLLM adapter reports per loaded chunk.
    """

    #: Host memory: this engine's, or any tier that keeps bytes in its CPU memory.
    HOST = "host"
    #: Another engine's memory.
    P2P = "p2p"
    #: A disk, local or shared, or an object store (as vLLM's own object tier says).
    DISK = "disk"
    #: A store outside the engines that is neither of the above (a remote memory
    #: server): vLLM's ``external_unspecified``.
    EXTERNAL = "external_unspecified"

    @classmethod
    def of(cls, medium: Medium) -> HitSource:
        """The source a tier on ``medium`` reports unless it declares its own."""
        return _SOURCE_OF_MEDIUM[medium]


_SOURCE_OF_MEDIUM = {
    Medium.GPU: HitSource.HOST,
    Medium.CPU: HitSource.HOST,
    Medium.STORAGE: HitSource.DISK,
    Medium.NETWORK: HitSource.P2P,
    Medium.REMOTE_MEMORY: HitSource.EXTERNAL,
}


@dataclass(frozen=True)
class ReqContext:
    """The request a scheduler call is made for.

    ``kv_transfer_params`` carries the host's per-request parameters untouched (the
    same dictionary vLLM hands its connectors); kvtier does not read it.
    ``load_tiers`` names the secondary tiers (by label) the request may load from, as
    vLLM's ``kv_load_tiers`` does: a chunk only other tiers hold is a miss for it. None
    (the default): every tier. The primary tier always serves.
    """

    req_id: str
    kv_transfer_params: Mapping[str, Any] | None = None
    load_tiers: frozenset[str] | None = None


class ScheduleEndContext(NamedTuple):
    """What the scheduler tells :meth:`on_schedule_end` about the step that ended."""

    #: Requests scheduled for the first time in this step.
    new_req_ids: Collection[str] = ()
    #: Requests preempted in this step.
    preempted_req_ids: Collection[str] = ()


@dataclass(frozen=True)
class OffloadingEvent:
    """Keys that were stored into, or removed from, one tier."""

    keys: tuple[OffloadKey, ...]
    medium: Medium
    #: True when the keys left the tier, False when they became readable in it.
    removed: bool
    #: The tier's label, ``"0:primary"`` for the primary tier, ``"<n>:<type>"`` for
    #: the n-th secondary tier.
    tier: str


@dataclass(frozen=True)
class LoadStoreSpec:
    """Where in the primary region a worker reads or writes: one slot per key."""

    chunk_ids: Sequence[int]


@dataclass(frozen=True)
class PrepareStoreOutput:
    """The answer of ``prepare_store``.

    ``keys_to_store`` are the keys of the call that were not yet stored, in call order;
    ``store_spec.chunk_ids[i]`` is the slot allocated for ``keys_to_store[i]``.
    ``evicted_keys`` left the primary tier to make room.
    """

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey] = field(default_factory=list)


@dataclass(frozen=True)
class TransferResult:
    """The outcome of one GPU <-> primary copy job of a worker."""

    job_id: int
    success: bool
    transfer_bytes: int
    #: Seconds from submission until the copy was known to be complete.
    transfer_time: float


class EventLog:
    """Events appended by one thread and taken by another without losing any."""

    __slots__ = ("_events", "enabled")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._events: deque[OffloadingEvent] = deque()

    def add(self, keys: Sequence[OffloadKey], medium: Medium, removed: bool, tier: str) -> None:
        if self.enabled and keys:
            self._events.append(OffloadingEvent(tuple(keys), medium, removed, tier))

    def take(self) -> list[OffloadingEvent]:
        events: list[OffloadingEvent] = []
        while self._events:
            events.append(self._events.popleft())
        return events
