"""vLLM 0.33 tier plugins under kvtier's manager: a ``SecondaryTierManager`` as a tier.

A tier written for vLLM's own ``TieringOffloadingSpec`` is a synchronous object that
vLLM's manager drives from its scheduler: it submits jobs and polls
``get_finished_jobs()`` for their ends, answers lookups HIT, MISS or RETRY, and hears of
requests and steps. :class:`VllmPluginTier` runs such an object as a kvtier tier, so a
configuration written for vLLM keeps its ``secondary_tiers`` entry when it names
``spec_name: KVTierOffloadingSpec``:

- It is built as vLLM builds it: vLLM's spec (``TierContext.host_spec``), the primary
  region as one memoryview shaped ``(rows, row_bytes)``, the tier's ``type`` and its
  own parameters unchanged. kvtier's back-pressure is in charge: the plugin gets no
  vLLM ``BackpressureDetector`` (``backpressure`` is kvtier's key, applied around it).
- Its jobs are submitted from the tier loop, and one task polls ``get_finished_jobs()``
  every millisecond while any is in flight (vLLM's own poll interval), calling
  ``on_schedule_end()`` with each round; the coroutine of each job awaits its result.
  The loop never blocks on the plugin beyond its own non-blocking calls.
- A lookup's RETRY is "being asked" (``contains`` answers None); the async lookup asks
  again each millisecond until HIT or MISS, bounded by ``lookup_timeout_s``.
- A job the plugin never reports ends as a counted miss at ``job_timeout_s``; its
  primary slots stay out of use until the plugin reports it (the adapter holds their
  rows until then, which the manager sees through ``PrimaryView.in_use``).
- Each stored row's checksum is kept in memory; a row the plugin loads back is served
  only if it matches (else an integrity failure, never served). A row stored by
  another process (a persistent tier after a restart) has no checksum here: it is
  served as the plugin loads it, as under vLLM, and counted in
  ``kvtier_plugin_unverified_chunks``. A row has no room for a header, so kvtier
  cannot store one beside the plugin's bytes without changing what the plugin stores.
- Its metrics (``build_metric_definitions``) are declared with kvtier's, and what its
  ``get_stats()`` reports is recorded through kvtier's metrics, so vLLM's stats carry
  it; its ``take_events()`` become the tier's KV events.

What kvtier has no moment for is not called: ``serve_external_requests`` (no parent
manager), ``config_info``. Lookups and ``touch`` carry one context of the adapter's
own, since kvtier asks a tier about keys, not requests; jobs carry their request's
context, opened with ``on_new_request`` and closed with ``on_request_finished``.

Only this module imports vLLM for a plugin; kvtier's tier factory reaches it only for
a class that derives from vLLM's ``SecondaryTierManager``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import anyio
import anyio.to_thread
import numpy
import xxhash
from vllm.v1.kv_offload import base as vllm_base
from vllm.v1.kv_offload.tiering import base as vllm_tiering
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory as VllmTierFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier._logs import ThrottledLog
from kvtier.errors import ConfigError
from kvtier.keys import OffloadKey
from kvtier.metrics import CounterDef, GaugeDef, HistogramDef, MetricDefinition
from kvtier.records import HitSource, Medium, OffloadingEvent
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob

__all__ = ["UNVERIFIED_CHUNKS", "VllmPluginTier", "adapter_for", "registered_tier"]

logger = logging.getLogger(__name__)

#: Chunks a plugin loaded that kvtier holds no checksum for (stored by another process).
UNVERIFIED_CHUNKS = "kvtier_plugin_unverified_chunks"

#: How often the finished jobs are polled while any is in flight, and a RETRY lookup
#: asked again: vLLM's own tier-poll interval, which its tiers are written for.
BUSY_POLL_S = 0.001
#: How often an idle plugin is asked for its stats, events and pending work: nothing
#: waits on them, and a scrape reads at most this much late.
IDLE_POLL_S = 0.05
#: Checksums kept, oldest dropped first: about 100 bytes each, so at most ~200 MB for
#: two million chunks (terabytes of KV at common chunk sizes); a key dropped is
#: served unverified, and counted.
MAX_CHECKSUMS = 1 << 21
#: Requests remembered as finished before a job of theirs came: a cascade follows its
#: request's end by a step or so, so the newest thousands are plenty.
MAX_FINISHED_KEPT = 4096
#: Threads hashing rows of one tier at once: xxh3 runs at memory speed, so two keep up
#: with any plugin while leaving the cores to the engine.
CHECKSUM_THREADS = 2

#: vLLM's constructor arguments, which the framework gives: never a plugin parameter.
_BUILT_BY_FRAMEWORK = ("offloading_spec", "primary_kv_view", "tier_type", "backpressure_detector")

_MEDIUM = {vllm_base.Medium.CPU: Medium.CPU, vllm_base.Medium.STORAGE: Medium.STORAGE}
_SOURCE = {
    CacheHitSource.HOST: HitSource.HOST,
    CacheHitSource.P2P: HitSource.P2P,
    CacheHitSource.DISK: HitSource.DISK,
}
#: What a step end tells a plugin: kvtier's steps are not the scheduler's.
_NO_STEP = vllm_base.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def registered_tier(name: str) -> type[vllm_tiering.SecondaryTierManager] | None:
    """The class vLLM's ``SecondaryTierFactory`` has registered as ``name``; None if none.

    Raises:
        ConfigError: (``type``) it is registered but does not import.
    """
    try:
        found: type[vllm_tiering.SecondaryTierManager] = VllmTierFactory.get_tier_class(
            {"type": name}
        )
    except ValueError:
        return None
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            "type", f"vLLM's SecondaryTierFactory registers {name!r}, which does not load: {exc}"
        ) from exc
    return found


@functools.cache
def adapter_for(plugin_class: type[vllm_tiering.SecondaryTierManager]) -> type[VllmPluginTier]:
    """The kvtier tier class that runs ``plugin_class``: one per plugin class, with the
    plugin's medium and hit source."""
    medium = _MEDIUM.get(plugin_class.medium, Medium.STORAGE) if plugin_class.medium else None
    namespace: dict[str, Any] = {
        "__module__": __name__,
        "__doc__": f"{plugin_class.__qualname__}, a vLLM tier plugin, run by kvtier.",
        "plugin_class": plugin_class,
        "medium": medium or Medium.STORAGE,
        "hit_source": _SOURCE.get(plugin_class.cache_hit_source, HitSource.EXTERNAL),
        "shared_keys": _shared_keys(plugin_class),
    }
    return type(f"VllmPluginTier[{plugin_class.__qualname__}]", (VllmPluginTier,), namespace)


#: Keys kvtier reads for every tier that vLLM also hands its tiers' constructors.
_VLLM_SHARED_KEYS = ("locality", "enable_kv_events")


def _shared_keys(plugin_class: type[vllm_tiering.SecondaryTierManager]) -> tuple[str, ...]:
    """Which of kvtier's keys the plugin also receives, as vLLM passes them: those its
    ``__init__`` names, or all of them where it takes any keyword."""
    parameters = inspect.signature(plugin_class.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return _VLLM_SHARED_KEYS
    names = {p.name for p in parameters}
    return tuple(key for key in _VLLM_SHARED_KEYS if key in names)


@dataclass
class _Request:
    """The plugin's context for a request, open while it has jobs or has not finished."""

    ctx: vllm_base.ReqContext
    jobs: int = 0
    finished: bool = False


@dataclass
class _Job:
    """A job the plugin has; its rows keep its slots in use until the plugin reports it."""

    job: TransferJob
    result: asyncio.Future[vllm_tiering.JobResult]
    rows: list[memoryview]


class VllmPluginTier(SecondaryTier):
    """A vLLM 0.33 ``SecondaryTierManager`` run as a kvtier tier (see the module).

    Built by :func:`adapter_for` for each plugin class; ``tier_class(ctx, **params)``
    with the plugin's own parameters, which reach the plugin unchanged.
    """

    plugin_class: ClassVar[type[vllm_tiering.SecondaryTierManager]]

    def __init__(self, ctx: TierContext, **params: Any) -> None:
        super().__init__(ctx)
        self._lock = threading.Lock()  # the plugin is never entered concurrently
        self._log = ThrottledLog(logger, f"tier {ctx.tier_name}")
        self._lookups = vllm_base.ReqContext(req_id=f"kvtier-lookups-{ctx.tier_name}")
        self._requests: dict[str, _Request] = {}
        #: Requests kvtier said finished while the plugin had no job of theirs: a
        #: cascade queued before that may still come (the newest only, as a bound).
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._jobs: dict[int, _Job] = {}
        self._checksums: dict[OffloadKey, int] = {}
        self._events: list[OffloadingEvent] = []
        self._hashing = anyio.CapacityLimiter(CHECKSUM_THREADS)
        self._wake: asyncio.Event | None = None
        self._poller: asyncio.Task[None] | None = None
        self._closed = False
        self._rows = ctx.primary_view.as_rows()
        self.plugin = self.plugin_class(
            offloading_spec=ctx.host_spec,
            primary_kv_view=self._rows,
            tier_type=ctx.tier_type,
            backpressure_detector=None,
            **params,
        )
        self.plugin.on_new_request(self._lookups)
        if self.plugin_class.serve_external_requests is not (
            vllm_tiering.SecondaryTierManager.serve_external_requests
        ):
            logger.warning(
                "tier %s: %s serves external requests, which kvtier does not call",
                ctx.tier_name,
                self.plugin_class.__qualname__,
            )

    # ------------------------------------------------------------ parameters

    @classmethod
    def check_params(cls, params: Mapping[str, Any], path: str) -> Mapping[str, Any]:
        """The plugin's parameters, checked against its ``__init__``; passed on as given.

        Raises:
            ConfigError: a parameter its ``__init__`` does not take, or one it requires
                that is missing (named ``<path>.<key>``).
        """
        accepted = [
            p
            for p in list(inspect.signature(cls.plugin_class.__init__).parameters.values())[1:]
            if p.name not in _BUILT_BY_FRAMEWORK
        ]
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted):
            names = {p.name for p in accepted}
            for key in params:
                if key not in names:
                    known = ", ".join(sorted(names)) or "none"
                    raise ConfigError(
                        f"{path}.{key}",
                        f"unknown parameter of {cls.plugin_class.__qualname__} (known: {known})",
                    )
        for p in accepted:
            named = p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            if named and p.default is p.empty and p.name not in params:
                raise ConfigError(f"{path}.{p.name}", "is required")
        return MappingProxyType(dict(params))

    @classmethod
    def build_metric_definitions(cls, settings: Any) -> dict[str, MetricDefinition]:
        """The plugin's own metrics (it gets its parameters as its tier configuration),
        and the count of chunks served unverified."""
        declared = cls.plugin_class.build_metric_definitions(dict(settings or {}))
        definitions = {name: _definition(name, meta) for name, meta in declared.items()}
        definitions[UNVERIFIED_CHUNKS] = CounterDef(
            "Chunks a vLLM tier plugin loaded that kvtier held no checksum for (stored by "
            "another process), served as loaded.",
            ("tier",),
        )
        return definitions

    # --------------------------------------------------------------- lookups

    def contains(self, key: OffloadKey) -> bool | None:
        if self._closed:
            return False
        try:
            with self._lock:
                answer = self.plugin.lookup(key, self._lookups)
        except Exception as exc:
            self._log.warning("lookup failure", "the plugin's lookup failed", error=exc)
            return False
        if answer is vllm_base.LookupResult.RETRY:
            return None  # the plugin is still finding out: kvtier asks lookup()
        return answer is vllm_base.LookupResult.HIT

    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        answers: dict[int, bool] = {}
        asking = list(range(len(keys)))
        while asking:
            with self._lock:
                results = [self.plugin.lookup(keys[i], self._lookups) for i in asking]
            retry = []
            for i, result in zip(asking, results, strict=True):
                if result is vllm_base.LookupResult.RETRY:
                    retry.append(i)
                else:
                    answers[i] = result is vllm_base.LookupResult.HIT
            asking = retry
            if asking:
                await asyncio.sleep(BUSY_POLL_S)
        return [answers[i] for i in range(len(keys))]

    # ------------------------------------------------------------------ jobs

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def store(self, job: TransferJob) -> JobResult:
        rows = [self.ctx.primary_view[chunk_id] for chunk_id in job.chunk_ids]
        sums = await anyio.to_thread.run_sync(_checksums, rows, limiter=self._hashing)
        # Known before the plugin may answer HIT for a key, so every load of it verifies.
        self._checksums.update(zip(job.keys, sums, strict=True))
        while len(self._checksums) > MAX_CHECKSUMS:
            del self._checksums[next(iter(self._checksums))]
        result = await self._run(job, rows, self.plugin.submit_store)
        return JobResult(
            job.job_id,
            bool(result.success),
            transfer_bytes=result.transfer_bytes,
            transfer_time=result.transfer_time,
        )

    async def load(self, job: TransferJob) -> JobResult:
        rows = [self.ctx.primary_view[chunk_id] for chunk_id in job.chunk_ids]
        result = await self._run(job, rows, self.plugin.submit_load)
        if result.success:
            reported = set(job.keys)
        else:
            reported = set(result.successful_keys or ()) & set(job.keys)
        loaded = [(key, row) for key, row in zip(job.keys, rows, strict=True) if key in reported]
        sums = await anyio.to_thread.run_sync(
            _checksums, [row for _, row in loaded], limiter=self._hashing
        )
        good: list[OffloadKey] = []
        corrupt = unverified = 0
        for (key, _), found in zip(loaded, sums, strict=True):
            expected = self._checksums.get(key)
            if expected is None:
                unverified += 1
                good.append(key)
            elif expected == found:
                good.append(key)
            else:
                corrupt += 1
        if unverified:
            self.ctx.metrics.inc(UNVERIFIED_CHUNKS, unverified, (self.ctx.tier_name,))
        if corrupt:
            self.ctx.report_integrity_failure(corrupt)
            self._log.warning(
                "corrupt",
                "promotion job %d: the plugin loaded %d chunk(s) whose bytes differ from "
                "what was stored; not served",
                job.job_id,
                corrupt,
            )
        return JobResult(
            job.job_id,
            len(good) == len(job.keys),
            successful_keys=good,
            transfer_bytes=result.transfer_bytes,
            transfer_time=result.transfer_time,
        )

    async def _run(
        self, job: TransferJob, rows: list[memoryview], submit: Any
    ) -> vllm_tiering.JobResult:
        """Submit ``job`` to the plugin and wait for its report.

        If this is cancelled (the job timed out), the job stays registered with its
        rows until the plugin reports it, so its slots stay out of use meanwhile.
        """
        future: asyncio.Future[vllm_tiering.JobResult] = asyncio.get_running_loop().create_future()
        with self._lock:
            vllm_job = vllm_tiering.TransferJob(
                job_id=job.job_id,
                keys=list(job.keys),
                chunk_ids=numpy.asarray(job.chunk_ids, dtype=numpy.int64),
                is_promotion=job.is_promotion,
                req_context=self._job_started(job.req_id),
            )
            self._jobs[job.job_id] = _Job(job, future, rows)
            try:
                submit(vllm_job)
            except BaseException:
                del self._jobs[job.job_id]
                self._job_ended(job.req_id)
                raise
        assert self._wake is not None, "the tier was not started"
        self._wake.set()
        return await future

    def _job_started(self, req_id: str) -> vllm_base.ReqContext:
        """The plugin's context for a job's request, opened with its first job
        (``on_new_request``). Under the lock."""
        request = self._requests.get(req_id)
        if request is None:
            request = self._requests[req_id] = _Request(vllm_base.ReqContext(req_id=req_id))
            request.finished = req_id in self._finished
            self._finished.pop(req_id, None)
            self.plugin.on_new_request(request.ctx)
        request.jobs += 1
        return request.ctx

    def _job_ended(self, req_id: str) -> None:
        """A job of the request was reported: once none is left and kvtier said the
        request finished, the plugin hears so (vLLM's order: after every submit). Under
        the lock."""
        request = self._requests.get(req_id)
        if request is None:
            return
        request.jobs -= 1
        if request.finished and not request.jobs:
            del self._requests[req_id]
            self.plugin.on_request_finished(request.ctx)

    # ---------------------------------------------------------------- polling

    async def _poll(self) -> None:
        """Hand the plugin's reports to the jobs awaiting them, every millisecond while
        it has work, else every :data:`IDLE_POLL_S` or when a job is submitted."""
        assert self._wake is not None
        while True:
            try:
                busy = self._poll_once()
            except Exception as exc:
                # The jobs it has not reported end at their time-out, as counted misses.
                self._log.warning("poll failure", "polling the plugin failed", error=exc)
                busy = False
            if busy:
                await asyncio.sleep(BUSY_POLL_S)
                continue
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)

    def _poll_once(self) -> bool:
        """One round: finished jobs, a step end, stats and events; whether work is left."""
        with self._lock:
            finished = list(self.plugin.get_finished_jobs())
            self.plugin.on_schedule_end(_NO_STEP)
            stats = self.plugin.get_stats()
            events = list(self.plugin.take_events())
            busy = self.plugin.has_pending_work()
        self._finish(finished)
        if stats is not None:
            self._record(stats)
        self._note(events)
        return busy or bool(self._jobs)

    def _finish(self, finished: Iterable[vllm_tiering.JobResult]) -> None:
        for result in finished:
            record = self._jobs.pop(result.job_id, None)
            if record is None:
                self._log.warning(
                    "unknown job",
                    "the plugin reported job %d, which it was not given",
                    result.job_id,
                )
                continue
            with self._lock:
                self._job_ended(record.job.req_id)
            if not record.result.done():  # else the job timed out: its rows go now
                record.result.set_result(result)

    def _record(self, stats: Any) -> None:
        """What the plugin's ``get_stats()`` returned, recorded as kvtier's metrics."""
        types, values = stats.metric_sections()
        metrics = self.ctx.metrics
        for name, by_labels in values.items():
            kind = types.get(name)
            for labels, value in by_labels.items():
                if kind == "counter":
                    metrics.inc(name, value, tuple(labels))
                elif kind == "gauge":
                    metrics.set(name, value, tuple(labels))
                elif kind == "histogram":
                    metrics.observe_many(name, value, tuple(labels))

    def _note(self, events: Sequence[vllm_base.OffloadingEvent]) -> None:
        for event in events:
            if event.removed:
                for key in event.keys:
                    self._checksums.pop(key, None)
            if self.ctx.enable_events and event.keys:
                self._events.append(
                    OffloadingEvent(
                        keys=tuple(event.keys),
                        medium=self.medium,
                        removed=event.removed,
                        tier=self.ctx.tier_name,
                    )
                )

    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    # -------------------------------------------------------------- requests

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        if self._closed:
            return
        try:
            with self._lock:
                self.plugin.touch(list(keys), self._lookups)
        except Exception as exc:
            self._log.warning("touch failure", "the plugin's touch failed", error=exc)

    def on_request_finished(self, req_id: str) -> None:
        try:
            with self._lock:
                request = self._requests.get(req_id)
                if request is None:
                    self._finished[req_id] = None
                    while len(self._finished) > MAX_FINISHED_KEPT:
                        self._finished.popitem(last=False)
                elif request.jobs:
                    request.finished = True  # it hears once they are reported
                elif not self._closed:
                    del self._requests[req_id]
                    self.plugin.on_request_finished(request.ctx)
        except Exception as exc:
            self._log.warning(
                "request failure", "the plugin's on_request_finished failed", error=exc
            )

    # -------------------------------------------------------------- shutdown

    async def aclose(self) -> None:
        """Stop polling, let the plugin drain its jobs (for at most ``job_timeout_s``)
        and shut it down."""
        if self._closed:
            return
        self._closed = True
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        with anyio.move_on_after(self.ctx.job_timeout_s) as scope:
            await anyio.to_thread.run_sync(self._shut_down, abandon_on_cancel=True)
        if scope.cancelled_caught:
            logger.error(
                "tier %s: %s did not drain its jobs within %g s; left behind",
                self.ctx.tier_name,
                self.plugin_class.__qualname__,
                self.ctx.job_timeout_s,
            )

    def _shut_down(self) -> None:
        """In a thread, once every job coroutine has ended: the plugin's last calls."""
        with self._lock:
            self.plugin.drain_jobs()
            self.plugin.get_finished_jobs()
            for ctx in [*(r.ctx for r in self._requests.values()), self._lookups]:
                self.plugin.on_request_finished(ctx)
            self._requests.clear()
            self._jobs.clear()
            self.plugin.shutdown()
        # The region's mapping closes once no view of it is left (vLLM releases its
        # tiers' view likewise); one the plugin still holds keeps it mapped.
        with contextlib.suppress(BufferError):
            self._rows.release()


def _checksums(rows: Sequence[memoryview]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(row) for row in rows]


def _definition(name: str, meta: vllm_base.OffloadingMetricMetadata) -> MetricDefinition:
    """vLLM's metadata for a plugin metric as kvtier's definition."""
    labels = tuple(meta.labelnames or ())
    if isinstance(meta, vllm_base.OffloadingHistogramMetadata):
        buckets = tuple(meta.buckets) if meta.buckets is not None else None
        return HistogramDef(meta.documentation, labels, buckets)
    if isinstance(meta, vllm_base.OffloadingGaugeMetadata):
        return GaugeDef(meta.documentation, labels)
    if isinstance(meta, vllm_base.OffloadingCounterMetadata):
        return CounterDef(meta.documentation, labels)
    raise ConfigError("secondary_tiers", f"metric {name!r}: unknown metadata type {meta!r}")
