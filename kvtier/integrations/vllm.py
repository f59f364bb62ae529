"""kvtier as vLLM's offloading backend: a spec vLLM 0.33 loads through ``spec_module_path``.

Name it in ``--kv-transfer-config``::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {
         "spec_name": "KVTierOffloadingSpec",
         "spec_module_path": "kvtier.integrations.vllm",
         "cpu_bytes_to_use": 8000000000,
         "secondary_tiers": [{"type": "fs", "root_dir": "/var/cache/kvtier"}]}}

vLLM's connector then drives kvtier's manager from its scheduler and kvtier's worker
from each GPU worker. This module, :mod:`kvtier.integrations.vllm_stats` (metric
definitions and stats) and :mod:`kvtier.integrations.vllm_tiers` (each tier's medium,
locality and hit source, and events) are the only ones in kvtier that import vLLM: they
translate at the boundary (vLLM's lookup results, load/store specs, events, metrics)
and keep kvtier itself free of vLLM. The ``extra_config`` is read by
:mod:`kvtier.integrations.vllm_config`, which ``kvtier plan`` uses too, with or without
vLLM installed.

What vLLM does differently from a kvtier host, and how the adapter answers it:

- vLLM never calls ``touch()``: hits seen by ``lookup`` are touched once per request
  and step, head of the prefix first, and loads touch their keys.
- vLLM drops the results of copies in flight at ``reset_cache()`` and says when they
  ended with ``on_reset_flushed()``: until then kvtier keeps their slots out of use.
- A load may begin inside a chunk (``block_indices``) when a chunk spans several GPU
  blocks: the worker copies only the blocks asked for.
- A hybrid model has several KV-cache groups (full attention beside sliding-window or
  Mamba layers). A key names its group, so each chunk is one group's; a slot is sized
  for the whole allocation (vLLM's ``worker_kv_bytes_per_block``) and each group copies
  through its own layers' tensors, which overlay the other groups' in vLLM's
  allocation. Every copy names how its blocks and slots divide among the groups
  (``group_sizes``; a sliding-window group may start inside its first chunk).
- Under tensor parallelism each worker rank copies only its own column of every slot;
  vLLM counts a job done once every rank reported it.
- With ``canonical_layout: true`` vLLM certifies each layer and gives every worker a
  map of its page into the page of a model without parallelism: the ranks scatter their
  fragments into one shared page per block, and the namespace names that format instead
  of the ranks, so engines of any tensor-parallel size share stored chunks. A
  configuration vLLM does not certify is refused at start.
- An MLA model under tensor parallelism (vLLM's ``replicated_layout``) keeps one copy of
  its latent KV per chunk, written by rank 0 (the canonical layout deals the pages
  out among the ranks instead) and read by every rank.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
    canonical_format_id,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload import base as vllm_base
from vllm.v1.kv_offload.config import OffloadingConfig as VllmOffloadingConfig

import kvtier
from kvtier.config import OffloadingConfig
from kvtier.errors import ConfigError
from kvtier.integrations.vllm_config import translate, translate_extra_config
from kvtier.integrations.vllm_stats import StatsRecorder, vllm_metric_definitions
from kvtier.integrations.vllm_tiers import TierDescriptions
from kvtier.keys import OffloadKey
from kvtier.metrics import MetricsRecorder
from kvtier.records import LookupResult, ReqContext, ScheduleEndContext
from kvtier.specs.cpu import CPUOffloadingSpec
from kvtier.specs.factory import spec_name_for
from kvtier.specs.tiering import TieringOffloadingSpec
from kvtier.tiering.manager import TieringOffloadingManager
from kvtier.worker.layout import PageMap, PageRun
from kvtier.worker.worker import GroupSplit, OffloadingWorker

__all__ = [
    "KVTierOffloadingManager",
    "KVTierOffloadingSpec",
    "KVTierOffloadingWorker",
    "KVTierSlots",
]

logger = logging.getLogger(__name__)

_LOOKUP = {
    LookupResult.MISS: vllm_base.LookupResult.MISS,
    LookupResult.HIT: vllm_base.LookupResult.HIT,
    LookupResult.HIT_PENDING: vllm_base.LookupResult.HIT_PENDING,
    LookupResult.RETRY: vllm_base.LookupResult.RETRY,
}
# The results compared by identity on the lookup path: an Enum's hash is a Python call,
# which made the mapping above a third of the adapter's own time per lookup.
_HIT, _HIT_PENDING = LookupResult.HIT, LookupResult.HIT_PENDING
_VLLM_HIT, _VLLM_HIT_PENDING = vllm_base.LookupResult.HIT, vllm_base.LookupResult.HIT_PENDING

_ENGINE_ID_BAD = re.compile(r"[^A-Za-z0-9_.-]")

#: Label names of ``vllm:kv_offload_config_info`` this spec fills.
_INFO_KEYS = ("backend", "tiers", "eviction_policy", "blocks_per_chunk")


def _kvtier_spec_class(extra_config: Mapping[str, Any]) -> type[CPUOffloadingSpec]:
    """The CPU spec when there are no secondary tiers (it alone has store_threshold)."""
    return _TieringSpec if spec_name_for(extra_config) == "TieringOffloadingSpec" else _CPUSpec


class _CPUSpec(CPUOffloadingSpec):
    def new_metrics(self) -> MetricsRecorder:
        return StatsRecorder(self.metric_definitions(self.settings.metrics), self.registry)


class _TieringSpec(TieringOffloadingSpec):
    def new_metrics(self) -> MetricsRecorder:
        return StatsRecorder(self.metric_definitions(self.settings.metrics), self.registry)


@dataclass(frozen=True)
class KVTierSlots(vllm_base.LoadStoreSpec):  # type: ignore[misc]
    """Where a load reads or a store writes: one primary slot per chunk.

    Travels pickled from the scheduler to the workers, so it holds plain integers.
    """

    chunk_ids: tuple[int, ...]

    def __repr__(self) -> str:
        return f"KVTierSlots{self.chunk_ids}"


class KVTierOffloadingSpec(vllm_base.OffloadingSpec):  # type: ignore[misc]
    """vLLM's ``OffloadingSpec`` over kvtier: the primary tier, then ``secondary_tiers``.

    Reads kvtier's ``extra_config`` keys (``cpu_bytes_to_use``, ``eviction_policy``,
    ``secondary_tiers``, ``backpressure``, ...) and accepts vLLM's own and those of
    vLLM's ``TieringOffloadingSpec`` and its tiers, translated by
    :mod:`kvtier.integrations.vllm_config` (each translation logged); the chunk size
    is the one vLLM resolved from ``block_size`` or ``blocks_per_chunk``. Models with
    several KV-cache groups store each group's chunks under its own keys; the groups
    are part of the storage namespace.

    Raises:
        ValueError: any invalid setting (:class:`~kvtier.ConfigError`, naming the
            key); from :meth:`get_worker`, KV pages of a group that its tensor or the
            slot cannot hold.
    """

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, vllm_base.OffloadingMetricMetadata]:
        translated = translate_extra_config(extra_config)
        definitions = _kvtier_spec_class(translated).build_metric_definitions(translated)
        return vllm_metric_definitions(definitions)

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return _INFO_KEYS

    def __init__(self, config: VllmOffloadingConfig) -> None:
        super().__init__(config)
        if not config.groups:
            raise ValueError("KVTierOffloadingSpec: vLLM offloads no KV-cache group")
        # The chunk's token count is the first group's; groups of other block sizes
        # (a Mamba group's larger blocks) name theirs in the namespace.
        tokens_per_block = config.groups[0].tokens_per_block
        translation = translate(config.extra_config)
        for reading in translation.readings:
            logger.info("vLLM's %s", reading)
        extra = translation.extra_config
        extra["block_size"] = tokens_per_block * self.blocks_per_chunk
        # vLLM's connector then lets rank 0 alone submit the stores of a direct layout.
        self.replicated_layout = bool(config.replicated_layout)
        self.kvtier_config = OffloadingConfig(
            engine_id=_engine_id(config.engine_id),
            kv_bytes_per_block=config.worker_kv_bytes_per_block,
            tokens_per_block=tokens_per_block,
            world_size=config.parallel.world_size,
            rank=config.parallel.rank,
            model_name=config.model.name,
            kv_dtype=_kv_format(config),
            extra_config=extra,
            enable_kv_events=config.enable_kv_cache_events,
            replicated=self.replicated_layout,
            **_canonical(config),
        )
        self.kvtier_spec: CPUOffloadingSpec = _kvtier_spec_class(extra)(self.kvtier_config)
        if isinstance(self.kvtier_spec, TieringOffloadingSpec):
            # A tier written for vLLM is built with vLLM's spec, as vLLM builds it.
            self.kvtier_spec.host_spec = self
        self._manager: KVTierOffloadingManager | None = None

    def get_manager(self) -> KVTierOffloadingManager:
        if self._manager is None:
            self._manager = KVTierOffloadingManager(self.kvtier_spec)
        return self._manager

    def get_worker(self, kv_caches: vllm_base.CanonicalKVCaches) -> KVTierOffloadingWorker:
        """This rank's worker over vLLM's canonical KV tensors, one group per
        ``group_data_refs`` entry (groups may share tensors).

        Raises:
            ValueError: a group's pages are larger than the tensor vLLM gave them (a
                packed layout whose layers alias at different page sizes), or the
                tensors hold more bytes per block than a slot's column.
        """
        groups = self.config.groups
        if len(kv_caches.group_data_refs) != len(groups):
            raise ValueError(
                f"KVTierOffloadingSpec was configured for {len(groups)} KV-cache "
                f"group(s), the worker got {len(kv_caches.group_data_refs)}"
            )
        for g, refs in enumerate(kv_caches.group_data_refs):
            for ref in refs:
                page = kv_caches.tensors[ref.tensor_idx].page_size_bytes
                if ref.page_size_bytes > page:
                    raise ValueError(
                        f"KV-cache group {groups[g].group_id} ({_group_kind(groups[g])}, "
                        f"layers {_layers(groups[g].layer_names)}) has "
                        f"{ref.page_size_bytes}-byte pages in a tensor of {page}-byte "
                        "pages shared with another group: kvtier copies whole pages of "
                        "each tensor and cannot store this group"
                    )
        tensors = [entry.tensor for entry in kv_caches.tensors]
        indices = [[ref.tensor_idx for ref in refs] for refs in kv_caches.group_data_refs]
        pages = _page_maps(kv_caches) if self.kvtier_config.layout == "canonical" else None
        return KVTierOffloadingWorker(
            self.kvtier_spec.create_worker(tensors, groups=indices, pages=pages)
        )


def _canonical(config: VllmOffloadingConfig) -> dict[str, str]:
    """kvtier's layout fields for vLLM's ``canonical_layout``.

    Raises:
        ConfigError: canonical_layout is asked for where vLLM does not certify the
            model's pages as the same under any parallelism, or vLLM resolved no KV
            cache layout to name the format by.
    """
    if not config.canonical_layout:
        return {}
    if not config.parallel.is_parallelism_agnostic:
        raise ConfigError(
            "canonical_layout",
            "vLLM does not certify this model's KV pages as the same under any "
            "parallelism (it does for attention layers whose KV heads are split evenly "
            "across tensor-parallel ranks, or an MLA latent, without pipeline or context "
            "parallelism); kvtier would store them in a form only engines of this "
            "topology read, so it refuses: remove canonical_layout",
        )
    if not config.kv_cache_layout:
        raise ConfigError(
            "canonical_layout", "vLLM resolved no KV cache layout to name the canonical format by"
        )
    return {"layout": "canonical", "canonical_format": canonical_format_id(config.kv_cache_layout)}


def _page_maps(kv_caches: vllm_base.CanonicalKVCaches) -> list[PageMap]:
    """Each KV tensor's map into the canonical page, from vLLM's per-layer mappings.

    Raises:
        ValueError: a layer's page is not certified (vLLM gave it no mapping), or layers
            sharing a tensor map it differently.
    """
    found: dict[int, Any] = {}
    for g, refs in enumerate(kv_caches.group_data_refs):
        for ref in refs:
            if ref.mapping is None or not ref.mapping.parallelism_agnostic:
                raise ValueError(
                    f"canonical_layout: vLLM could not certify a layer of KV-cache group "
                    f"{g} (KV tensor {ref.tensor_idx}) for the canonical layout; kvtier "
                    "refuses to store it in a topology-dependent form: remove "
                    "canonical_layout"
                )
            if found.setdefault(ref.tensor_idx, ref.mapping) != ref.mapping:
                raise ValueError(
                    f"canonical_layout: layers sharing KV tensor {ref.tensor_idx} map its "
                    "pages differently; kvtier copies one map per tensor"
                )
    missing = [i for i in range(len(kv_caches.tensors)) if i not in found]
    if missing:
        raise ValueError(f"canonical_layout: no layer maps KV tensor(s) {missing}")
    return [
        PageMap(
            page_bytes=mapping.canonical_page_size_bytes,
            runs=tuple(
                PageRun(
                    local_offset=run.local_offset,
                    shared_offset=run.canonical_offset,
                    size=run.fragment_size,
                    count=run.num_fragments,
                    local_stride=run.local_stride,
                    shared_stride=run.canonical_stride,
                )
                for run in mapping.runs
            ),
            writers=mapping.num_writers,
            writer_index=mapping.writer_index,
        )
        for mapping in (found[i] for i in range(len(kv_caches.tensors)))
    ]


def _engine_id(engine_id: str) -> str:
    """vLLM's engine id as a name kvtier accepts for its /dev/shm region."""
    name = _ENGINE_ID_BAD.sub("_", engine_id)[:128] or "vllm"
    return name if name[0].isalnum() else f"v{name[:127]}"


def _kv_format(config: VllmOffloadingConfig) -> str:
    """The KV dtype, and for several groups what each one's chunks hold: part of the
    storage namespace, so engines whose groups split the layers otherwise never read
    each other's chunks. One group keeps the dtype alone (the namespace of a model
    without groups stays what it was)."""
    dtype: str = config.model.dtype
    if len(config.groups) == 1:
        return dtype
    described = ",".join(_group_format(group) for group in config.groups)
    return f"{dtype};groups={described}"


def _group_format(group: Any) -> str:
    """``<tokens per block>x<layers>``, then ``w<chunks>`` for a windowed group."""
    window = group.sliding_window_size_in_chunks
    shape = f"{group.tokens_per_block}x{len(group.layer_names)}"
    return shape if window is None else f"{shape}w{window}"


def _layers(names: Sequence[str]) -> str:
    """A group's first layer names, for a message."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _group_kind(group: Any) -> str:
    """What vLLM's group config says of a group's kind."""
    window = group.sliding_window_size_in_chunks
    if window is None:
        return "full attention"
    return f"windowed: sliding-window, chunked-local or Mamba, {window} chunk(s)"


class KVTierOffloadingManager(vllm_base.OffloadingManager):  # type: ignore[misc]
    """vLLM's scheduler-side manager interface over kvtier's manager."""

    def __init__(self, spec: CPUOffloadingSpec) -> None:
        self.spec = spec
        self.kvtier: TieringOffloadingManager = spec.get_manager()
        metrics = self.kvtier.metrics
        self._stats = metrics if isinstance(metrics, StatsRecorder) else None
        # The adapter's own state only: kvtier's manager takes its lock in every call,
        # its tier loop never evicts, and a request's own promotions never evict a key
        # it found readable, so a HIT stays readable until vLLM's prepare_load for it
        # (in update_state_after_alloc, before the next request is looked up).
        self._lock = threading.RLock()
        #: Keys each request saw as HIT this step, in lookup (prefix) order.
        self._hits: dict[str, dict[OffloadKey, None]] = {}
        self._tiers = TierDescriptions(self.kvtier.tiers, spec.settings.tiers)
        #: vLLM's context of the request looked up last, and kvtier's for it: vLLM
        #: looks a request's keys up one after another.
        self._last_context: tuple[vllm_base.ReqContext | None, ReqContext] = (
            None,
            ReqContext(""),
        )
        #: Whether the tiers had work at the last stats call (True: the first call
        #: flushes what was counted at start-up).
        self._was_busy = True

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def _context(self, req_context: vllm_base.ReqContext) -> ReqContext:
        """kvtier's context for a vLLM request, made once and kept on vLLM's; its
        ``load_tiers`` are the tiers vLLM's ``kv_load_tiers`` filter allows."""
        last_vllm, last = self._last_context
        if req_context is last_vllm:  # most calls in a row are for one request
            return last
        ctx: ReqContext | None = req_context.get_state(ReqContext)
        if ctx is None:
            load_tiers = self._tiers.load_tiers(req_context.load_tier_filter)
            ctx = ReqContext(req_context.req_id, req_context.kv_transfer_params, load_tiers)
            req_context.set_state(ctx)
        self._last_context = (req_context, ctx)
        return ctx

    # -------------------------------------------------------------- lookups

    def lookup(self, key: OffloadKey, req_context: vllm_base.ReqContext) -> vllm_base.LookupResult:
        last_vllm, ctx = self._last_context
        if req_context is not last_vllm:
            ctx = self._context(req_context)
        result = self.kvtier.lookup(key, ctx)
        if result is _HIT:
            hits = self._hits.get(ctx.req_id)
            if hits is None:
                hits = self._hits[ctx.req_id] = {}
            hits[key] = None
            return _VLLM_HIT
        if result is _HIT_PENDING:
            return _VLLM_HIT_PENDING
        return _LOOKUP[result]

    def get_load_source(self, key: OffloadKey, req_context: vllm_base.ReqContext) -> Any:
        # The manager's own record of the tier that promoted the key for the request.
        # The source the tier declares (SecondaryTier.hit_source).
        return self._tiers.hit_source(self.kvtier.host.load_source(key, self._context(req_context)))

    # ---------------------------------------------------------------- loads

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: vllm_base.ReqContext
    ) -> KVTierSlots:
        ctx = self._context(req_context)
        ordered = list(keys)
        spec = self.kvtier.prepare_load(ordered, ctx)
        self._touch(ctx, ordered)
        return KVTierSlots(tuple(int(slot) for slot in spec.chunk_ids))

    def touch(self, keys: Collection[OffloadKey], req_context: vllm_base.ReqContext) -> None:
        self.kvtier.touch(list(keys), self._context(req_context))

    def complete_load(
        self, keys: Collection[OffloadKey], req_context: vllm_base.ReqContext
    ) -> None:
        self.kvtier.complete_load(list(keys), self._context(req_context))

    def _touch(self, ctx: ReqContext, loaded: Sequence[OffloadKey]) -> None:
        """Record the use of a request's hits and loads, head of the prefix first."""
        hits = self._hits.pop(ctx.req_id, {})
        for key in loaded:
            hits[key] = None
        if hits:
            self.kvtier.touch(list(hits), ctx)

    # --------------------------------------------------------------- stores

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: vllm_base.ReqContext
    ) -> vllm_base.PrepareStoreOutput | None:
        out = self.kvtier.prepare_store(list(keys), self._context(req_context))
        if out is None:
            return None
        # The lists are the manager's answer to this call alone: vLLM may keep them.
        return vllm_base.PrepareStoreOutput(
            keys_to_store=out.keys_to_store,
            store_spec=KVTierSlots(tuple(map(int, out.store_spec.chunk_ids))),
            evicted_keys=out.evicted_keys,
        )

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        req_context: vllm_base.ReqContext,
        success: bool = True,
    ) -> None:
        self.kvtier.complete_store(list(keys), self._context(req_context), success)

    # ------------------------------------------------------------- requests

    def on_new_request(
        self, req_context: vllm_base.ReqContext
    ) -> vllm_base.RequestOffloadingContext:
        self.kvtier.on_new_request(self._context(req_context))
        return vllm_base.RequestOffloadingContext()

    def on_request_finished(self, req_context: vllm_base.ReqContext) -> None:
        ctx = self._context(req_context)
        self._hits.pop(ctx.req_id, None)
        self.kvtier.on_request_finished(ctx)

    def on_schedule_end(self, context: vllm_base.ScheduleEndContext) -> None:
        if self._hits:
            hits, self._hits = self._hits, {}
            for req_id, keys in hits.items():
                self.kvtier.touch(list(keys), ReqContext(req_id))
        self.kvtier.on_schedule_end(
            ScheduleEndContext(
                new_req_ids=context.new_req_ids, preempted_req_ids=context.preempted_req_ids
            )
        )

    def has_pending_work(self) -> bool:
        return self.kvtier.has_pending_work()

    # --------------------------------------------------------------- events

    def take_events(self) -> Iterable[vllm_base.OffloadingEvent]:
        return [self._tiers.event(event) for event in self.kvtier.take_events()]

    # ------------------------------------------------------------ lifecycle

    def reset_cache(self) -> None:
        self._hits.clear()
        # vLLM forgets the copies in flight now and reports them ended through
        # on_reset_flushed; their slots must not be handed out before that.
        self.kvtier.reset_cache(hold_busy_slots=True)

    def on_reset_flushed(self) -> None:
        self.kvtier.on_reset_flushed()

    def get_stats(self) -> OffloadingConnectorStats | None:
        if self._stats is None:
            return None
        # vLLM asks on every step. kvtier hands its counts to the recorder at the end of
        # a step at most every FLUSH_INTERVAL_S; flushing on each call as well cost
        # 20 us a step here, ten times kvtier's own step end. What a flush has not
        # handed over yet follows with the next one, or at once when the tiers fall
        # idle, so a burst's last counts do not wait for the next burst.
        busy = self.kvtier.has_pending_work()
        pull, self._was_busy = self._was_busy and not busy, busy
        return self._stats.take(pull=pull)

    def config_info(self) -> Sequence[Mapping[str, str | int | float | bool]]:
        spec = self.spec
        return [
            {
                "backend": f"kvtier {kvtier.__version__}",
                "tiers": ",".join(self.kvtier.diagnostics.tier_labels) or "none",
                "eviction_policy": spec.settings.eviction_policy,
                "blocks_per_chunk": spec.blocks_per_chunk,
            }
        ]

    def shutdown(self) -> None:
        # vLLM's verb for a blocking close: what this adapter owns closes with close().
        self.spec.close()


class KVTierOffloadingWorker(vllm_base.OffloadingWorker):  # type: ignore[misc]
    """vLLM's worker interface over kvtier's worker for one rank."""

    def __init__(self, worker: OffloadingWorker) -> None:
        self.kvtier = worker
        self._num_groups = len(worker.layout.groups)

    def submit_store(
        self, job_id: int, src_spec: vllm_base.GPULoadStoreSpec, dst_spec: KVTierSlots
    ) -> bool:
        if self._num_groups > 1:
            self.kvtier.submit_store(
                job_id, src_spec.block_ids, dst_spec.chunk_ids, groups=self._split(src_spec)
            )
        else:
            self.kvtier.submit_store(
                job_id, src_spec.block_ids, dst_spec.chunk_ids, skip_blocks=self._skip(src_spec)
            )
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: KVTierSlots,
        dst_spec: vllm_base.GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        # kvtier starts every load at once, so an expedited one queues behind nothing
        # of kvtier's; vLLM then waits for it with wait().
        if self._num_groups > 1:
            self.kvtier.submit_load(
                job_id, src_spec.chunk_ids, dst_spec.block_ids, groups=self._split(dst_spec)
            )
        else:
            self.kvtier.submit_load(
                job_id, src_spec.chunk_ids, dst_spec.block_ids, skip_blocks=self._skip(dst_spec)
            )
        return True

    def _skip(self, gpu_spec: vllm_base.GPULoadStoreSpec) -> int:
        """Blocks of the first chunk before the copy starts (vLLM's block_indices)."""
        if len(gpu_spec.group_sizes) != 1:
            raise ValueError(
                f"this worker has one KV-cache group, a copy named {len(gpu_spec.group_sizes)}"
            )
        return int(gpu_spec.block_indices[0]) % self.kvtier.blocks_per_chunk

    def _split(self, gpu_spec: vllm_base.GPULoadStoreSpec) -> GroupSplit:
        """How a copy's blocks divide among the groups, each starting where vLLM's
        ``block_indices`` says inside its first chunk."""
        bpc = self.kvtier.blocks_per_chunk
        return GroupSplit(
            sizes=[int(size) for size in gpu_spec.group_sizes],
            skips=[int(index) % bpc for index in gpu_spec.block_indices],
        )

    def get_finished(self) -> list[vllm_base.TransferResult]:
        return [
            vllm_base.TransferResult(
                job_id=result.job_id,
                success=result.success,
                transfer_size=result.transfer_bytes,
                transfer_time=result.transfer_time,
            )
            for result in self.kvtier.get_finished()
        ]

    def wait(self, job_ids: set[int]) -> None:
        self.kvtier.wait(job_ids)

    def shutdown(self) -> None:
        # vLLM's verb for a blocking close: the worker closes with close().
        self.kvtier.close()
