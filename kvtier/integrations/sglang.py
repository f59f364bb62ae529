"""kvtier as SGLang's HiCache storage backend (SGLang 0.5.23, loaded at run time).

Launch SGLang with the hierarchical cache and name this backend::

    python -m sglang.launch_server --model-path MODEL --page-size 64 \\
        --enable-hierarchical-cache --hicache-mem-layout page_first \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
            "module_path": "kvtier.integrations.sglang",
            "class_name": "KVTierHiCacheStorage", "interface_v1": 1,
            "kvtier": {"cpu_bytes_to_use": 8000000000,
                       "secondary_tiers": [{"type": "fs", "root_dir": "/var/cache/kvtier"}]}}'

``"kvtier"`` is a kvtier ``extra_config`` in the shape the vLLM integration reads
(``cpu_bytes_to_use``, ``eviction_policy``, ``secondary_tiers``, ``backpressure``, ...).
One SGLang page is one kvtier chunk, named by SGLang's own chained page hash.

With ``--hicache-host-memory-mode buffer_only`` SGLang's host memory only stages
writes: it frees a host page as soon as the backend acknowledges it. The backend reads
the mode from SGLang's published server arguments and then acknowledges a page only
once a secondary tier that keeps copies of its own (fs, s3, redis, memcached,
mooncake, a plugin; not p2p) has stored it; without such a tier, once the primary tier
has it, which then holds SGLang's whole storage (``cpu_bytes_to_use``).

kvtier's side needs no SGLang: :class:`PageStore` (:class:`kvtier.hosts.PageStore`, the
engine-neutral store of fixed-size pages for synchronous threads, re-exported here)
moves bytes between the caller's page memory and kvtier's primary slots with one copy
each way; this module adds SGLang's names for pages (:func:`page_key`) and its
configuration (:func:`offloading_config`). :class:`KVTierHiCacheStorage`, SGLang's
``HiCacheStorage`` subclass, is built on first access
(``kvtier/integrations/_sglang_backend.py``), so importing this module never imports
SGLang; it only translates SGLang's calls, host pools and configuration.

How SGLang's threads reach kvtier's event loop: every call goes through the manager's
synchronous scheduler API (``lookup``, ``prepare_load`` / ``complete_load``,
``prepare_store`` / ``complete_store``, ``on_schedule_end``) under ``manager.lock``,
and waits for tier work through the host layer (:func:`kvtier.hosts.step_until_blocking`);
the tiers run on the manager's own loop thread. A caller waits only for the tier work
its call asked for, and never past the deadline it was given: what has not arrived by
then is a miss.

A prefix found by :meth:`PageStore.contains_prefix` starts its promotions at once
(kvtier promotes on a secondary hit), so the chunks are on their way while SGLang
allocates host memory; the request that found them stays open (a *session*) until
:meth:`PageStore.load` takes the pages or a lease runs out, so promotions still
queued are not dropped in between.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.integrations._sglang_store import (
    IOSample,
    PageStore,
    Segment,
    UnsupportedPoolError,
    offloading_config,
    page_key,
)

if TYPE_CHECKING:
    from kvtier.integrations._sglang_backend import KVTierHiCacheStorage

__all__ = [
    "IOSample",
    "KVTierHiCacheStorage",
    "PageStore",
    "Segment",
    "UnsupportedPoolError",
    "offloading_config",
    "page_key",
]


def __getattr__(name: str) -> Any:
    # SGLang's HiCacheStorage is imported only when its subclass is asked for: SGLang's
    # backend factory does getattr(module, class_name).
    if name == "KVTierHiCacheStorage":
        from kvtier.integrations._sglang_backend import KVTierHiCacheStorage

        return KVTierHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
