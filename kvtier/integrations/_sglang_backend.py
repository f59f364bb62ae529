"""SGLang's ``HiCacheStorage`` over kvtier's :class:`~kvtier.hosts.PageStore`.

Imported only when SGLang (or a user) asks ``kvtier.integrations.sglang`` for
``KVTierHiCacheStorage``; everything that needs no SGLang lives in that module.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
)

from kvtier.errors import ConfigError
from kvtier.integrations._sglang_store import (
    REQUEST_PREFIX,
    PageStore,
    Segment,
    UnsupportedPoolError,
    offloading_config,
    page_key,
)
from kvtier.keys import OffloadKey

__all__ = ["KVTierHiCacheStorage"]

logger = logging.getLogger(__name__)

# SGLang's own defaults for how long a prefetch may take (its extra-config keys
# prefetch_timeout_base and prefetch_timeout_per_ki_token), used when its settings
# cannot be read (a backend built outside a server).
_DEFAULT_TIMEOUT_BASE_S = 1.0
_DEFAULT_TIMEOUT_PER_KI_TOKEN_S = 0.25

_engine_ids = itertools.count()


class KVTierHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """kvtier's tiers as SGLang's L3 storage: ``--hicache-storage-backend dynamic``.

    SGLang builds it from its extra config (``{"backend_name": "kvtier", "module_path":
    "kvtier.integrations.sglang", "class_name": "KVTierHiCacheStorage", "interface_v1":
    1, "kvtier": {...}}``, ``"kvtier"`` holding kvtier's ``extra_config``); the tiers
    start when SGLang registers its host KV pool, whose page geometry sizes the chunks.

    Both of SGLang's interfaces are served: the zero-copy one (``batch_get_v1`` /
    ``batch_set_v1`` with host indices; selected by ``interface_v1``), which copies
    each page once between SGLang's host pool and a kvtier primary slot, and the generic
    one (``batch_get`` / ``batch_set`` with flat page tensors). A chunk holds the page
    as SGLang's flat page (``get_data_page(flat=True)``) lays it out, whichever
    interface wrote it.

    Each call waits at most as long as SGLang gives a prefetch of its pages
    (``prefetch_timeout_base`` + ``prefetch_timeout_per_ki_token`` per 1024 tokens);
    what has not arrived by then is a miss.

    Under ``--hicache-host-memory-mode buffer_only`` (read from SGLang's published
    server arguments) SGLang frees its host page as soon as a write is acknowledged,
    so kvtier's copy is the only one: a page is acknowledged only once a secondary
    tier that keeps copies of its own (fs, s3, redis, memcached, mooncake, a plugin;
    not p2p) reported it stored, and until then the cascade pins it in the primary
    tier. A write then also waits for that cascade (up to that tier's
    ``job_timeout_s`` more). A page whose cascade fails, times out or is dropped by
    back-pressure is not acknowledged. Without such a tier the primary tier is the only
    copy: a page is acknowledged once it is there, and stays until the primary tier,
    full, evicts it for newer pages (``cpu_bytes_to_use`` is then the size of SGLang's
    whole storage).

    Raises (while SGLang attaches it, which then fails):
        ConfigError: an invalid ``"kvtier"`` setting, heterogeneous tensor
            parallelism (``tp_lcm_size``), which kvtier does not store, or a store gate
            (``store_threshold`` >= 2) under ``buffer_only``, where a page it skipped
            would be acknowledged and lost.
        UnsupportedPoolError: a host pool other than the KV pool (Mamba, SWA, DSA
            indexer pools of hybrid models), or a KV pool whose page kvtier cannot map.
    """

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None
    ) -> None:
        extra = dict(storage_config.extra_config or {})
        kvtier_config = extra.get("kvtier", {})
        if not isinstance(kvtier_config, Mapping):
            raise ConfigError("kvtier", "expected a mapping of kvtier settings")
        if storage_config.should_split_heads:
            raise ConfigError(
                "tp_lcm_size",
                "kvtier stores each rank's own pages; heterogeneous tensor parallelism "
                "(splitting heads across tp sizes) is not supported: remove tp_lcm_size",
            )
        self.storage_config = storage_config
        self.kvtier_config: Mapping[str, Any] = kvtier_config
        self.zero_copy = bool(extra.get("interface_v1", 0))
        self.page_store: PageStore | None = None
        self._page_tokens = 0
        self._kv_pairs = False
        self._timeout_base_s, self._timeout_per_token_s = _prefetch_timeouts()
        self._stats_enabled = bool(storage_config.enable_storage_metrics)
        #: SGLang's ``--hicache-host-memory-mode``: ``"buffer_only"`` makes kvtier's copy
        #: of a page the only one once it is acknowledged.
        self.host_memory_mode = _host_memory_mode()

    # ---------------------------------------------------------- registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host KV pool: its pages size kvtier's chunks, and the tiers start."""
        super().register_mem_pool_host(mem_pool_host)
        if self.page_store is not None:
            return
        page_tokens = int(mem_pool_host.page_size)
        page_bytes = _flat_page_bytes(mem_pool_host)
        if hasattr(mem_pool_host, "get_page_buffer_meta"):
            _, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(page_tokens))
            if sum(sizes) != page_bytes:
                raise UnsupportedPoolError(
                    f"{type(mem_pool_host).__name__} ({mem_pool_host.layout}): its zero-copy "
                    f"page holds {sum(sizes)} bytes, its flat page {page_bytes}"
                )
        elif self.zero_copy:
            raise UnsupportedPoolError(
                f"{type(mem_pool_host).__name__} has no zero-copy page buffers: remove interface_v1"
            )
        self._page_tokens = page_tokens
        self._kv_pairs = _is_mha(mem_pool_host)
        config = offloading_config(
            self.kvtier_config,
            engine_id=f"sglang-{os.getpid()}-{next(_engine_ids)}",
            page_tokens=page_tokens,
            page_bytes=page_bytes,
            model_name=self.storage_config.model_name or "",
            kv_format=(
                f"{mem_pool_host.dtype};{type(mem_pool_host).__name__};"
                f"layout={mem_pool_host.layout}"
            ),
            shard=_shard(self.storage_config),
        )
        buffer_only = self.host_memory_mode == "buffer_only"
        try:
            self.page_store = PageStore(
                config, request_prefix=REQUEST_PREFIX, lasting_acks=buffer_only
            )
        except ConfigError as exc:
            if buffer_only and exc.path == "store_threshold":
                raise ConfigError(
                    "kvtier.store_threshold",
                    "--hicache-host-memory-mode buffer_only leaves kvtier the only copy of "
                    "a page, and a store gate skips pages: remove store_threshold",
                ) from exc
            raise
        logger.info(
            "kvtier HiCache storage: %d-token pages of %d bytes, namespace %s, tiers %s, "
            "host memory mode %s (a write is acknowledged once %s)",
            page_tokens,
            page_bytes,
            self.page_store.namespace,
            ", ".join(self.page_store.manager.diagnostics.tier_labels) or "none",
            self.host_memory_mode,
            (
                "a tier that keeps copies has it"
                if self.page_store.lasting_wait_s
                else "the primary tier has it"
            ),
        )

    def on_host_pools_registered(self) -> None:
        pools = getattr(self, "registered_pools", {})
        others = sorted(str(name) for name in pools if name != PoolName.KV)
        if others:
            raise UnsupportedPoolError(
                f"kvtier stores KV pages only; this model also has host pools {others} "
                "(hybrid attention, Mamba or indexer state): use another storage backend"
            )

    # ------------------------------------------------------------- lookups

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Leading pages any tier holds; their promotions into the primary tier start."""
        store = self._store()
        return store.contains_prefix([page_key(k) for k in keys], self._budget(len(keys)))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---------------------------------------------------- zero-copy interface

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Pages into the host pool at ``host_indices``, straight from primary slots."""
        store = self._store()
        return self._move(store.load, keys, host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Pages of the host pool at ``host_indices`` into primary slots, then the tiers."""
        store = self._store()
        return self._move(store.store, keys, host_indices, self._store_budget(len(keys)))

    def _move(
        self,
        move: Callable[[Sequence[OffloadKey], Sequence[Sequence[Segment]], float], list[bool]],
        keys: list[str],
        host_indices: torch.Tensor,
        timeout: float | None = None,
    ) -> list[bool]:
        """One zero-copy batch: the pages at ``host_indices`` through ``move``, within
        ``timeout`` (None: the time SGLang gives a prefetch of them)."""
        pages = self._host_pages(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        if timeout is None:
            timeout = self._budget(len(keys))
        return move([page_key(k) for k in keys], pages, timeout)

    def _host_pages(
        self, keys: Sequence[str], host_indices: torch.Tensor
    ) -> list[list[Segment]] | None:
        count = len(keys)
        if count == 0:
            return []
        expected = count * self._page_tokens
        if host_indices.numel() != expected:
            logger.error(
                "kvtier HiCache storage: %d page(s) need %d host indices, got %d",
                count,
                expected,
                host_indices.numel(),
            )
            return None
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per_page = len(ptrs) // count
        pages: list[list[Segment]] = []
        for first in range(0, per_page * count, per_page):
            segments = list(
                zip(ptrs[first : first + per_page], sizes[first : first + per_page], strict=True)
            )
            if self._kv_pairs:
                # MHA pages come as (K, V) pairs (one pair per layer in layer_first);
                # the flat page, and so the chunk, holds every K, then every V.
                segments = segments[0::2] + segments[1::2]
            pages.append(segments)
        return pages

    # ------------------------------------------------------ generic interface

    def batch_get(
        self,
        keys: list[str],
        target_locations: list[torch.Tensor] | None = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """Pages into flat page tensors (new ones if none are given); None where missing."""
        store = self._store()
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        pages = [[_tensor_segment(t)] for t in target_locations]
        done = store.load([page_key(k) for k in keys], pages, self._budget(len(keys)))
        return [t if ok else None for t, ok in zip(target_locations, done, strict=True)]

    def get(
        self, key: str, target_location: torch.Tensor | None = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_set(
        self,
        keys: list[str],
        values: list[torch.Tensor] | None = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Flat page tensors into the tiers; whether every page is stored."""
        store = self._store()
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set needs one flat page tensor per key")
        contiguous = [value.contiguous() for value in values]
        pages = [[_tensor_segment(value)] for value in contiguous]
        stored = store.store([page_key(k) for k in keys], pages, self._store_budget(len(keys)))
        return all(stored)

    def set(
        self,
        key: str,
        value: torch.Tensor | None = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if value is None:
            raise ValueError("set needs a flat page tensor")
        return self.batch_set([key], [value])

    # ------------------------------------------------------------- control

    def clear(self) -> bool:
        """Drop every page stored: the primary tier is emptied and each secondary tier
        deletes the chunks of this backend's namespace (an fs tier's files, an s3 tier's
        objects; a p2p tier holds none of its own). False if a tier kept some."""
        kept = self._store().clear()
        if kept:
            logger.warning(
                "kvtier HiCache storage: tier(s) %s kept their chunks when asked to clear",
                ", ".join(kept),
            )
        return not kept

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` for the calls since the last one (pages per call
        and GB/s of each load and store), when storage metrics are enabled."""
        if not self._stats_enabled or self.page_store is None:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        loads, stores = self.page_store.take_io_samples()
        metrics = StorageMetrics()
        metrics.prefetch_pgs.extend(sample.pages for sample in loads)
        metrics.prefetch_bandwidth.extend(_gbps(sample.nbytes, sample.seconds) for sample in loads)
        metrics.backup_pgs.extend(sample.pages for sample in stores)
        metrics.backup_bandwidth.extend(_gbps(sample.nbytes, sample.seconds) for sample in stores)
        return metrics

    def close(self) -> None:
        """Drain and close the tiers and release the primary region. Idempotent."""
        if self.page_store is not None:
            self.page_store.close()

    # --------------------------------------------------------------- helpers

    def _store(self) -> PageStore:
        if self.page_store is None:
            raise RuntimeError(
                "KVTierHiCacheStorage has no host pool yet: SGLang registers one with "
                "register_mem_pool_host before any I/O"
            )
        return self.page_store

    def _budget(self, pages: int) -> float:
        """The time SGLang gives a prefetch of ``pages`` pages."""
        return self._timeout_base_s + self._timeout_per_token_s * pages * self._page_tokens

    def _store_budget(self, pages: int) -> float:
        """The time a write of ``pages`` pages may take: what a prefetch of them gets,
        plus, where a write waits for lasting copies, the time their cascade may take."""
        return self._budget(pages) + self._store().lasting_wait_s


def _prefetch_timeouts() -> tuple[float, float]:
    """SGLang's prefetch time-out settings (base seconds, seconds per token), read the
    way its cache does (the controller removes them from the backend's extra config)."""
    try:
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
        from sglang.srt.runtime_context import get_memory

        raw = get_memory().hicache_storage_backend_extra_config
        _, _, base, per_ki_token, _ = HybridCacheController.parse_storage_backend_extra_config(raw)
    except Exception:  # settings not published (a backend built outside a server)
        logger.debug("SGLang's prefetch time-outs are not readable; using its defaults")
        base, per_ki_token = _DEFAULT_TIMEOUT_BASE_S, _DEFAULT_TIMEOUT_PER_KI_TOKEN_S
    return float(base), float(per_ki_token) / 1024


def _host_memory_mode() -> str:
    """SGLang's ``--hicache-host-memory-mode`` as its server published it (``"cache"``
    when nothing is published: a backend built outside a server)."""
    try:
        from sglang.srt.runtime_context import get_memory

        mode = get_memory().hicache_host_memory_mode
    except Exception:  # settings not published
        logger.debug("SGLang's host memory mode is not readable; assuming 'cache'")
        return "cache"
    return str(mode or "cache")


def _shard(config: HiCacheStorageConfig) -> str:
    """Which part of the model's KV this rank holds, as a name ("" when all of it)."""
    parts: list[str] = []
    # MLA ranks hold the same latent KV and one rank writes it: they share chunks.
    if not config.is_mla_model and config.tp_size > 1:
        parts.append(f"tp{config.tp_rank}of{config.tp_size}")
    if config.pp_size > 1:
        parts.append(f"pp{config.pp_rank}of{config.pp_size}")
    if config.attn_cp_size > 1:
        parts.append(f"cp{config.attn_cp_rank}of{config.attn_cp_size}")
    if config.dcp_size > 1:
        parts.append(f"dcp{config.dcp_rank}of{config.dcp_size}")
    return "-".join(parts)


def _flat_page_bytes(host_pool: Any) -> int:
    page = host_pool.get_dummy_flat_data_page()
    return int(page.numel() * page.element_size())


def _is_mha(host_pool: Any) -> bool:
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    return isinstance(host_pool, MHATokenToKVPoolHost)


def _tensor_segment(tensor: torch.Tensor) -> Segment:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("a flat page must be a contiguous CPU tensor")
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0
