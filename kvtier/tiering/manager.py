"""The scheduler-facing orchestrator of the tiers."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.keys import OffloadKey
from kvtier.metrics import MetricsRecorder, Names
from kvtier.primary import PrimaryTier
from kvtier.records import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
    ScheduleEndContext,
)
from kvtier.region import SharedOffloadRegion

__all__ = ["TieringOffloadingManager"]

logger = logging.getLogger(__name__)

_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING
_MISS = LookupResult.MISS


class LookupCounter:
    """Counts lookups per key for the ``store_threshold`` gate, in bounded memory.

    Only the ``max_tracked`` most recently looked-up keys are remembered: a key that
    falls out starts counting again, which errs on the side of not storing.
    """

    def __init__(self, threshold: int, max_tracked: int) -> None:
        self.threshold = threshold
        self.max_tracked = max_tracked
        self._counts: OrderedDict[OffloadKey, int] = OrderedDict()

    def count(self, key: OffloadKey) -> None:
        counts = self._counts
        if key in counts:
            counts.move_to_end(key)
            counts[key] += 1
        else:
            if len(counts) >= self.max_tracked:
                counts.popitem(last=False)
            counts[key] = 1

    def admitted(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        counts, threshold = self._counts, self.threshold
        return [key for key in keys if counts.get(key, 0) >= threshold]


@dataclass(slots=True)
class _RequestState:
    pending_stores: int = 0
    finished: ReqContext | None = None


class TieringOffloadingManager:
    """Keeps track of what every tier holds and moves chunks between them.

    All scheduler-facing methods are synchronous and never block: they change
    in-memory state only. The manager has exactly one writer at a time; a host that
    calls it from more than one thread holds :attr:`lock` around each call.
    """

    def __init__(
        self,
        primary: PrimaryTier,
        *,
        region: SharedOffloadRegion | None = None,
        metrics: MetricsRecorder | None = None,
        store_threshold: int = 0,
        max_tracked_lookups: int = 64_000,
    ) -> None:
        self.primary = primary
        self.lock = threading.RLock()
        self.metrics = metrics if metrics is not None else MetricsRecorder({})
        self._region = region
        self._records = primary.records
        self._gate = (
            LookupCounter(store_threshold, max_tracked_lookups) if store_threshold >= 2 else None
        )
        self._requests: dict[str, _RequestState] = {}
        self._closed = False
        # Counters flushed to Prometheus once per step (see _flush_metrics).
        self._stores_skipped = 0
        self._evictions = 0
        self._allocation_sizes: list[int] = []

    @property
    def region(self) -> SharedOffloadRegion | None:
        return self._region

    # -------------------------------------------------------------- lookups

    def lookup(self, key: OffloadKey, req: ReqContext) -> LookupResult:
        """Where ``key`` stands: HIT, HIT_PENDING, MISS or RETRY."""
        gate = self._gate
        if gate is not None:
            gate.count(key)
        record = self._records.get(key)
        if record is not None:
            return _HIT if record.ref_cnt >= 0 else _HIT_PENDING
        return _MISS

    # ---------------------------------------------------------------- loads

    def prepare_load(self, keys: Sequence[OffloadKey], req: ReqContext) -> LoadStoreSpec:
        """Pin ``keys`` (all HIT) for a primary -> GPU load; the spec gives their slots."""
        return self.primary.prepare_load(keys)

    def touch(self, keys: Sequence[OffloadKey], req: ReqContext) -> None:
        """Record a use of ``keys`` (first = head of the prefix) in every tier."""
        self.primary.touch(keys)

    def complete_load(self, keys: Sequence[OffloadKey], req: ReqContext) -> None:
        """Unpin ``keys`` after the GPU read them."""
        self.primary.complete_load(keys)

    # --------------------------------------------------------------- stores

    def prepare_store(
        self, keys: Sequence[OffloadKey], req: ReqContext
    ) -> PrepareStoreOutput | None:
        """Allocate primary slots for the keys not stored yet; None if there is no room."""
        gate = self._gate
        if gate is not None:
            admitted = gate.admitted(keys)
            self._stores_skipped += len(keys) - len(admitted)
            keys = admitted
        output = self.primary.prepare_store(keys)
        if output is None:
            return None
        if output.keys_to_store:
            self._allocation_sizes.append(len(output.keys_to_store))
            self._evictions += len(output.evicted_keys)
            state = self._requests.get(req.req_id)
            if state is None:
                state = self._requests[req.req_id] = _RequestState()
            state.pending_stores += 1
        return output

    def complete_store(
        self, keys: Sequence[OffloadKey], req: ReqContext, success: bool = True
    ) -> None:
        """Finish a GPU -> primary store: the keys become readable, or are freed."""
        self.primary.complete_store(keys, success)
        state = self._requests.get(req.req_id)
        if state is not None and state.pending_stores > 0:
            state.pending_stores -= 1
            self._maybe_finish_request(req.req_id, state)

    # ------------------------------------------------------------- requests

    def on_new_request(self, req: ReqContext) -> None:
        """A request entered the scheduler."""

    def on_request_finished(self, req: ReqContext) -> None:
        """A request left the scheduler; its pending stores may still complete."""
        state = self._requests.get(req.req_id)
        if state is None:
            return
        state.finished = req
        self._maybe_finish_request(req.req_id, state)

    def _maybe_finish_request(self, req_id: str, state: _RequestState) -> None:
        if state.pending_stores == 0 and state.finished is not None:
            del self._requests[req_id]

    # ----------------------------------------------------------------- steps

    def on_schedule_end(self, ctx: ScheduleEndContext | None = None) -> None:
        """End of a scheduler step."""
        self._flush_metrics()

    def take_events(self) -> list[OffloadingEvent]:
        """Store and eviction events since the last call, primary first."""
        return self.primary.take_events()

    def has_pending_work(self) -> bool:
        """Whether any job or lookup is in flight."""
        return False

    def reset_cache(self) -> None:
        """Forget everything the primary tier holds."""
        self.primary.reset()
        self._requests.clear()

    # -------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Release the region. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._flush_metrics()
        if self._region is not None:
            self._region.close()

    async def aclose(self) -> None:
        self.shutdown()

    async def wait_for_completions(self) -> None:
        """Resolve once any job or lookup finished (at once when none is in flight)."""

    async def drain(self) -> None:
        """Resolve once all in-flight work is done."""

    # --------------------------------------------------------------- metrics

    def _flush_metrics(self) -> None:
        metrics = self.metrics
        primary = self.primary
        metrics.set(Names.CPU_CACHE_USAGE_PERC, primary.num_busy / primary.num_chunks)
        if self._allocation_sizes:
            metrics.observe_many(Names.CPU_ALLOCATION_SIZE, self._allocation_sizes)
            self._allocation_sizes = []
        if self._evictions:
            metrics.inc(Names.CPU_EVICTIONS, self._evictions)
            self._evictions = 0
        if self._stores_skipped:
            metrics.inc(Names.STORES_SKIPPED, self._stores_skipped)
            self._stores_skipped = 0
