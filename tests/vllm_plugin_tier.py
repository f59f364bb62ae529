"""A secondary tier written only against vLLM 0.33's ``SecondaryTierManager`` interface.

What a vLLM user would bring along: it keeps chunks in a dictionary, copies them in a
thread of its own and reports jobs through ``get_finished_jobs()``, takes its own
parameters, declares a metric and reports it through ``get_stats()``. Nothing in it
knows kvtier. ``store`` names a dictionary of this process that tiers built with the
same name share (as a disk outlives an engine); by default each tier has its own.
Three parameters make it misbehave for tests: ``stall_loads`` keeps every load job
unreported until :meth:`ThreadedDictTier.release`, ``fail_loads`` reports every load
job failed, ``corrupt_loads`` flips a byte of each row it loads and reports success.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

#: The counter this tier declares: chunks it stored, by its ``label`` parameter.
STORED_CHUNKS = "test_plugin_stored_chunks"

#: Every tier built, newest last, for tests to inspect.
INSTANCES: list[ThreadedDictTier] = []
#: The dictionaries named by ``store``.
STORES: dict[str, dict[OffloadKey, bytes]] = {}


class ThreadedDictTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        label: str,
        stall_loads: bool = False,
        fail_loads: bool = False,
        corrupt_loads: bool = False,
        store: str | None = None,
        locality: str | None = None,
        enable_kv_events: bool = False,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality_written = locality
        self.enable_kv_events = enable_kv_events
        self.offloading_spec = offloading_spec
        self.label = label
        self.stall_loads = stall_loads
        self.fail_loads = fail_loads
        self.corrupt_loads = corrupt_loads
        self.chunks: dict[OffloadKey, bytes] = {} if store is None else STORES.setdefault(store, {})
        self.requests_seen: set[str] = set()
        self.requests_finished: set[str] = set()
        self.shut_down = False
        self._flat = primary_kv_view.cast("B")
        self._lock = threading.Lock()
        self._finished: list[JobResult] = []
        self._events: list[OffloadingEvent] = []
        self._stats = OffloadingConnectorStats()
        self._in_flight = 0
        self._released = threading.Event()
        self._queue: queue.Queue[TransferJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="dict-tier", daemon=True)
        self._thread.start()
        INSTANCES.append(self)

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return {
            STORED_CHUNKS: OffloadingCounterMetadata(
                documentation="Chunks the test tier stored.", labelnames=("label",)
            )
        }

    def release(self) -> None:
        """Let stalled load jobs finish."""
        self._released.set()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        with self._lock:
            return LookupResult.HIT if key in self.chunks else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        with self._lock:
            self._in_flight += 1
        self._queue.put(job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        with self._lock:
            self._in_flight += 1
        self._queue.put(job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def has_pending_work(self) -> bool:
        with self._lock:
            return self._in_flight > 0

    def take_events(self) -> Iterable[OffloadingEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.requests_seen.add(req_context.req_id)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.requests_finished.add(req_context.req_id)

    def get_stats(self) -> OffloadingConnectorStats | None:
        with self._lock:
            stats, self._stats = self._stats, OffloadingConnectorStats()
        return None if stats.is_empty() else stats

    def drain_jobs(self) -> None:
        done = self._drained = threading.Event()
        self._queue.put(None)  # the worker sets it once every job before it has ended
        done.wait()

    def shutdown(self) -> None:
        self.shut_down = True
        self._queue.put(None)
        self._thread.join()
        self._flat.release()  # the region's mapping may close

    def _work(self) -> None:
        size = self.block_size_bytes
        while True:
            job = self._queue.get()
            if job is None:
                drained = getattr(self, "_drained", None)
                if drained is not None:
                    drained.set()
                if self.shut_down:
                    return
                continue
            keys = list(job.keys)
            rows = [int(c) * size for c in job.chunk_ids]
            if not job.is_promotion:
                stored = {
                    key: bytes(self._flat[at : at + size])
                    for key, at in zip(keys, rows, strict=True)
                }
                with self._lock:
                    self.chunks.update(stored)
                    self._stats.increase_counter(STORED_CHUNKS, len(keys), (self.label,))
                    self._events.append(
                        OffloadingEvent(keys=keys, medium=Medium.CPU, removed=False)
                    )
                    self._end(JobResult(job_id=job.job_id, success=True))
                continue
            if self.stall_loads:
                self._released.wait()
            if self.fail_loads:
                with self._lock:
                    self._end(JobResult(job_id=job.job_id, success=False))
                continue
            with self._lock:
                data = [self.chunks.get(key) for key in keys]
            loaded = []
            for key, at, chunk in zip(keys, rows, data, strict=True):
                if chunk is not None:
                    self._flat[at : at + size] = chunk
                    if self.corrupt_loads:
                        self._flat[at] ^= 0xFF
                    loaded.append(key)
            with self._lock:
                self._end(
                    JobResult(
                        job_id=job.job_id,
                        success=len(loaded) == len(keys),
                        successful_keys=loaded,
                    )
                )

    def _end(self, result: JobResult) -> None:
        self._finished.append(result)
        self._in_flight -= 1
