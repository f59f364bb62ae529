"""SGLang 0.5.23's real HiCache controllers over its real host pool, on the CPU.

Shared by the SGLang integration tests (``nox -s sglang``) and
``benchmarks/sglang_backend.py``. :class:`HiCacheHost` builds a CPU device KV pool,
SGLang's host pool (built by hand: SGLang's own assembler registers the memory with
CUDA), and a ``HybridCacheController`` (what SGLang's scheduler builds) or a
``HiCacheController``, with a storage backend attached by SGLang's own factory. It then
plays the scheduler's part the way ``UnifiedRadixCache`` does: it puts pages in the
host pool (the device -> host copy cannot run without a GPU), asks the controller to
back them up, and runs prefetches through the controller's threads: the hit query,
``allocate_storage_hit``, the I/O thread, the acks.

Page contents are derived from the page's own hash, so any page holding other bytes is
caught wherever it ends up.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from queue import Empty
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvtier.integrations.sglang import PageStore

# SGLang warns at import about GPU-only features (AWQ, GGUF) it cannot use here.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.runtime_context import get_context, get_memory, get_parallel

__all__ = [
    "KVTIER_BACKEND",
    "Geometry",
    "HiCacheHost",
    "configure_process",
    "kvtier_extra_config",
    "page_contents",
]

#: The extra-config keys that load kvtier through SGLang's ``dynamic`` backend.
KVTIER_BACKEND = {
    "backend_name": "kvtier",
    "module_path": "kvtier.integrations.sglang",
    "class_name": "KVTierHiCacheStorage",
}

# How long a test waits for one of the controller's queues: its threads answer in
# milliseconds; this only bounds a hang.
QUEUE_TIMEOUT_S = 60.0

_configured: dict[str, Any] = {}


@dataclass(frozen=True)
class Geometry:
    """The KV pools' shape: one page is ``page_tokens`` tokens of every layer."""

    page_tokens: int = 8
    layers: int = 4
    heads: int = 4
    head_dim: int = 32
    dtype: torch.dtype = torch.bfloat16
    layout: str = "page_first"
    #: Tokens the host pool holds.
    host_tokens: int = 8192

    @property
    def page_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.page_tokens * self.heads * self.head_dim * itemsize


def configure_process(
    page_tokens: int,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    storage_extra_config: Mapping[str, Any] | None = None,
) -> None:
    """Publish the server arguments and ranks SGLang's pools read (once per process).

    ``storage_extra_config`` is what the server would have in
    ``--hicache-storage-backend-extra-config``: the backend reads SGLang's prefetch
    time-outs from it.
    """
    wanted = {
        "page_tokens": page_tokens,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "extra": json.dumps(dict(storage_extra_config or {}), sort_keys=True),
    }
    if _configured:
        if _configured != wanted:
            raise RuntimeError(f"this process is configured for {_configured}, not {wanted}")
        return
    fields: dict[str, Any] = {
        "page_size": page_tokens,
        "device": "cpu",
        "hicache_mem_layout": "page_first",
    }
    if storage_extra_config:
        fields["hicache_storage_backend_extra_config"] = wanted["extra"]
    get_context().override_server_args(**fields).install()
    # Attention and MoE tensor parallelism span the same ranks (no DP attention, no EP).
    get_parallel().override_permanently(
        tp_rank=tp_rank,
        tp_size=tp_size,
        attn_tp_rank=tp_rank,
        attn_tp_size=tp_size,
        moe_tp_rank=tp_rank,
        moe_tp_size=tp_size,
        pp_rank=0,
        attn_dcp_rank=0,
    )
    _configured.update(wanted)


def kvtier_extra_config(kvtier: Mapping[str, Any], *, zero_copy: bool = True) -> dict[str, Any]:
    """SGLang's storage extra config that loads kvtier with these kvtier settings."""
    return {**KVTIER_BACKEND, "interface_v1": int(zero_copy), "kvtier": dict(kvtier)}


def open_host(
    hosts: list[HiCacheHost], kvtier: Mapping[str, Any], *, zero_copy: bool = True, **kwargs: Any
) -> HiCacheHost:
    """A host whose backend is kvtier with these settings (:func:`kvtier_extra_config`),
    appended to ``hosts``, whose owner closes it; ``kwargs`` go to :class:`HiCacheHost`."""
    host = HiCacheHost("dynamic", kvtier_extra_config(kvtier, zero_copy=zero_copy), **kwargs)
    hosts.append(host)
    return host


def store_of(host: HiCacheHost) -> PageStore:
    """The kvtier ``PageStore`` behind a host opened by :func:`open_host`."""
    from kvtier.integrations.sglang import PageStore

    store = host.backend.page_store
    assert isinstance(store, PageStore)
    return store


def page_contents(page_hash: str, geometry: Geometry, salt: str = "") -> torch.Tensor:
    """The flat page stored under ``page_hash``: bytes that only this page has (and
    only this ``salt``: a tensor-parallel rank's share of the page)."""
    digest = hashlib.blake2b(f"{salt}/{page_hash}".encode(), digest_size=8).digest()
    seed = int.from_bytes(digest, "big")
    gen = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    elements = geometry.page_bytes // torch.empty((), dtype=geometry.dtype).element_size()
    return torch.randn(elements, generator=gen).to(geometry.dtype)


class HiCacheHost:
    """A controller, its host pool and its storage backend, driven like SGLang's cache.

    ``backend`` and ``extra_config`` are what ``--hicache-storage-backend`` and
    ``--hicache-storage-backend-extra-config`` would say (``"dynamic"`` plus
    :func:`kvtier_extra_config`, or ``"file"`` plus ``file_storage_path``).
    ``controller`` is ``"hybrid"`` (SGLang 0.5.23's scheduler builds this one) or
    ``"plain"``. ``host_memory_mode`` is ``--hicache-host-memory-mode``: published as
    the server would while the controller and its backend are built, and given to the
    controller.
    """

    def __init__(
        self,
        backend: str,
        extra_config: Mapping[str, Any],
        *,
        geometry: Geometry | None = None,
        controller: str = "hybrid",
        model_name: str = "kvtier-test-model",
        tp_group: Any = None,
        salt: str = "",
        host_memory_mode: str = "cache",
    ) -> None:
        self.geometry = geometry = geometry or Geometry()
        self.salt = salt
        if not _configured:
            configure_process(geometry.page_tokens)
        elif _configured["page_tokens"] != geometry.page_tokens:
            raise RuntimeError(
                f"this process is configured for {_configured['page_tokens']}-token pages"
            )
        page = geometry.page_tokens
        device_tokens = max(256, page * 16)
        self.device_pool = MHATokenToKVPool(
            size=device_tokens,
            page_size=page,
            dtype=geometry.dtype,
            head_num=geometry.heads,
            head_dim=geometry.head_dim,
            layer_num=geometry.layers,
            device="cpu",
            enable_memory_saver=False,
        )
        allocator = PagedTokenToKVPoolAllocator(
            device_tokens, page, geometry.dtype, "cpu", self.device_pool, need_sort=False
        )
        info = self.device_pool.get_device_pool_infos()[0].buffer_info
        # The host pool checks free RAM less a reserve; a fixed budget keeps that
        # independent of what else the machine runs.
        with host_memory_budget_scope(1 << 40):
            self.host_pool = MHATokenToKVPoolHost(
                info,
                1.0,
                0,  # host_size: host_token_capacity sets the size
                page,
                geometry.layout,
                pin_memory=False,
                device="cpu",
                device_capacity_tokens=self.device_pool.size,
                start_layer=self.device_pool.start_layer,
                end_layer=self.device_pool.end_layer,
                host_token_capacity=geometry.host_tokens,
            )
        layers = {i: i for i in range(geometry.layers)}
        common: dict[str, Any] = {
            "page_size": page,
            "tp_group": tp_group,
            "load_cache_event": threading.Event(),
            "io_backend": "direct",
            "storage_backend": backend,
            "model_name": model_name,
            "storage_backend_extra_config": dict(extra_config),
            "host_memory_mode": host_memory_mode,
        }
        self.hybrid = controller == "hybrid"
        with get_memory().override(hicache_host_memory_mode=host_memory_mode):
            self.controller: Any = self._controller(controller, allocator, layers, common)
        self._requests = 0

    def _controller(
        self, kind: str, allocator: Any, layers: dict[int, int], common: dict[str, Any]
    ) -> Any:
        geometry = self.geometry
        if kind == "hybrid":
            group = HostPoolGroup(
                [
                    build_pool_entry(
                        name=PoolName.KV,
                        host_pool=self.host_pool,
                        device_pool=self.device_pool,
                        layer_mapping=layers,
                        transfer_layer_id_max=geometry.layers,
                        is_anchor=True,
                    )
                ]
            )
            return HybridCacheController(allocator, group, **common)
        if kind == "plain":
            return HiCacheController(allocator, self.host_pool, **common)
        raise ValueError(f"controller must be 'hybrid' or 'plain', not {kind!r}")

    # ------------------------------------------------------------------ pages

    @property
    def backend(self) -> Any:
        """The storage backend the controller calls (SGLang's failure injector, when
        its environment variables are set, wraps the real one)."""
        return self.controller.storage_backend

    def hashes(self, tokens: Sequence[int]) -> list[str]:
        """SGLang's chained page hashes of ``tokens`` (whole pages only)."""
        return list(get_storage_hash_str(list(tokens), None, page_size=self.geometry.page_tokens))

    def fill(self, tokens: Sequence[int]) -> torch.Tensor:
        """Host pages holding the KV of ``tokens`` (as if the GPU had written it back)."""
        page = self.geometry.page_tokens
        hashes = self.hashes(tokens)
        indices = self.alloc(len(hashes) * page)
        for i, page_hash in enumerate(hashes):
            self.host_pool.set_from_flat_data_page(
                int(indices[i * page]), page_contents(page_hash, self.geometry, self.salt)
            )
        return indices

    def alloc(self, tokens: int) -> torch.Tensor:
        indices = self.host_pool.alloc(tokens)
        if indices is None:
            raise RuntimeError(f"the host pool has no room for {tokens} tokens")
        return indices

    def free(self, indices: torch.Tensor) -> None:
        self.host_pool.free(indices)

    def scribble(self, indices: torch.Tensor) -> None:
        """Fill host pages with a pattern no stored page has (to catch stray writes)."""
        page = self.geometry.page_tokens
        marker = torch.full(
            (
                self.geometry.page_bytes
                // torch.empty((), dtype=self.geometry.dtype).element_size(),
            ),
            -7.0,
            dtype=self.geometry.dtype,
        )
        for first in range(0, len(indices), page):
            self.host_pool.set_from_flat_data_page(int(indices[first]), marker)

    def page_at(self, indices: torch.Tensor, page_index: int) -> torch.Tensor:
        """The flat page the host pool holds at page ``page_index`` of ``indices``."""
        first = int(indices[page_index * self.geometry.page_tokens])
        return self.host_pool.get_data_page(first, flat=True).clone()

    def matching_pages(self, indices: torch.Tensor, hashes: Sequence[str]) -> list[bool]:
        """For each page of ``indices``, whether it holds the contents of its hash."""
        return [
            torch.equal(
                self.page_at(indices, i), page_contents(page_hash, self.geometry, self.salt)
            )
            for i, page_hash in enumerate(hashes)
        ]

    def untouched_pages(self, indices: torch.Tensor, count: int) -> list[bool]:
        """For each of ``count`` pages of ``indices``, whether it still holds the
        :meth:`scribble` pattern."""
        marker = -7.0
        return [bool((self.page_at(indices, i).float() == marker).all()) for i in range(count)]

    # ---------------------------------------------------- the scheduler's part

    def backup(self, tokens: Sequence[int], indices: torch.Tensor | None = None) -> int:
        """Back the host pages of ``tokens`` up to storage through the backup thread;
        the tokens it reported stored."""
        if indices is None:
            indices = self.fill(tokens)
        hashes = self.hashes(tokens)
        page = self.geometry.page_tokens
        indices = indices[: len(hashes) * page]
        op_id = self.controller.write_storage(
            indices, list(tokens), hash_value=hashes, prefix_keys=[]
        )
        operation = self.controller.ack_backup_queue.get(timeout=QUEUE_TIMEOUT_S)
        assert operation.id == op_id, "the backup thread acknowledged another operation"
        return int(operation.completed_tokens)

    def backup_and_free(self, tokens: Sequence[int]) -> int:
        """:meth:`backup`, then free the host pages at the acknowledgement, as SGLang's
        ``buffer_only`` mode does (host memory only stages writes), and let other pages
        take them over at once (:meth:`scribble`); the tokens reported stored."""
        indices = self.fill(tokens)
        try:
            return self.backup(tokens, indices)
        finally:
            self.free(indices)
            reused = self.alloc(len(indices))
            self.scribble(reused)
            self.free(reused)

    def prefetch(
        self, tokens: Sequence[int], *, scribble: bool = False
    ) -> tuple[int, int, torch.Tensor | None]:
        """Prefetch ``tokens`` from storage through the controller's threads.

        Returns the tokens the hit query found, the tokens the I/O thread completed,
        and the host indices they went to (None when nothing was found; the caller
        frees them). With ``scribble`` the host pages get the :meth:`scribble` pattern
        before the I/O thread fills them.
        """
        self._requests += 1
        rid = f"req-{self._requests}"
        controller = self.controller
        if self.hybrid:
            handle = CacheRequestHandle(rid=rid, attempt_id=0)
            controller.prefetch(handle, list(tokens), None, prefix_keys=[])
        else:
            controller.prefetch(rid, list(tokens), None, prefix_keys=[])
        operation = controller.prefetch_hit_queue.get(timeout=QUEUE_TIMEOUT_S)
        hit = int(operation.storage_hit_count)
        if hit == 0:
            return 0, 0, None
        if self.hybrid:
            indices, _ = controller.allocate_storage_hit(
                operation, hit, allow_partial=False, min_tokens=0, evict_host=lambda n: 0
            )
        else:
            indices = controller.mem_pool_host.alloc(hit)
        if indices is None:
            raise RuntimeError(f"the host pool has no room for {hit} prefetched tokens")
        if scribble:
            self.scribble(indices)
        operation.host_indices = indices
        controller.prefetch_buffer.put(operation)
        completed = 0
        while True:
            ack = controller.ack_prefetch_queue.get(timeout=QUEUE_TIMEOUT_S)
            if ack.completed_tokens is not None:
                completed = max(completed, int(ack.completed_tokens))
            if ack.completed_req:
                break
        return hit, completed, indices

    def drain_queues(self) -> None:
        """Nothing may be left in the controller's queues between operations."""
        for name in ("prefetch_hit_queue", "ack_prefetch_queue", "ack_backup_queue"):
            queue = getattr(self.controller, name)
            try:
                leftover = queue.get_nowait()
            except Empty:
                continue
            raise AssertionError(f"{name} still holds {leftover!r}")

    def threads_alive(self) -> bool:
        """Whether the controller's storage threads all still run."""
        threads = [
            getattr(self.controller, name, None)
            for name in ("prefetch_thread", "prefetch_io_aux_thread", "backup_thread")
        ]
        return all(t is not None and t.is_alive() for t in threads)

    def close(self) -> None:
        """Detach the backend as SGLang does: stop the storage threads, then close it."""
        self.controller.detach_storage_backend()


@contextmanager
def env(**values: str) -> Iterator[None]:
    """Environment variables set for the duration (SGLang reads some at attach)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
