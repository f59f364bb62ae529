"""Helpers of the SGLang integration tests, and their child processes' entry points.

Imported only by ``tests/integrations/sglang`` (it imports SGLang through
``benchmarks/sglang_host.py``).
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

MIB = 1 << 20

#: SGLang's prefetch time-outs in the test processes (what a server's extra config would
#: say): a slow tier's test waits this long, not SGLang's default second.
PREFETCH_TIMEOUTS = {"prefetch_timeout_base": 2.0, "prefetch_timeout_per_ki_token": 0.25}


def fs_config(root: Path, *, cpu_bytes: int = 4 * MIB, **tier: Any) -> dict[str, Any]:
    """kvtier settings: a primary tier and an fs tier under ``root``."""
    return {
        "cpu_bytes_to_use": cpu_bytes,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), **tier}],
    }


def tp_rank(rank: int, size: int, root: str, tokens: list[int], conn: Connection) -> None:
    """One tensor-parallel rank of a server: its own process, SGLang ranks published,
    its own host pool and kvtier backend over the shared fs ``root``.

    Stores ``tokens`` with this rank's bytes, waits for the word, then empties its
    primary tier and prefetches them back from disk; reports what it read.
    """
    from sglang_host import HiCacheHost, configure_process, kvtier_extra_config

    configure_process(8, tp_rank=rank, tp_size=size)
    host = HiCacheHost(
        "dynamic",
        kvtier_extra_config(fs_config(Path(root))),
        salt=f"rank{rank}",
    )
    try:
        stored = host.backup(tokens)
        store = host.backend.page_store
        store.manager.reset_cache()
        conn.send(("stored", stored, store.namespace))
        assert conn.recv() == "read"
        hit, completed, indices = host.prefetch(tokens, scribble=True)
        exact = host.matching_pages(indices, host.hashes(tokens)) if indices is not None else []
        conn.send(("read", hit, completed, exact))
    finally:
        host.close()
        conn.close()
