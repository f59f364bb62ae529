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


def tp_rank(
    rank: int, size: int, port: int, root: str, tokens: list[int], conn: Connection
) -> None:
    """One tensor-parallel rank of a server in its own process: SGLang's ranks
    published, a gloo group with the other ranks (SGLang agrees on prefetch hits and
    completions through it), its own host pool and kvtier backend over the shared fs
    ``root``.

    Stores ``tokens`` with this rank's share of the bytes and empties its primary tier;
    on the word, prefetches them back from disk and reports what it read.
    """
    import torch.distributed as dist
    from sglang_host import HiCacheHost, configure_process, kvtier_extra_config

    configure_process(8, tp_rank=rank, tp_size=size, storage_extra_config=PREFETCH_TIMEOUTS)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    host = HiCacheHost(
        "dynamic",
        kvtier_extra_config(fs_config(Path(root))),
        salt=f"rank{rank}",
        tp_group=dist.group.WORLD,
    )
    try:
        stored = host.backup(tokens)
        store = host.backend.page_store
        store.manager.reset_cache()
        conn.send(("stored", stored, store.namespace))
        assert conn.recv() == "read"
        hit, completed, indices = host.prefetch(tokens, scribble=True)
        assert indices is not None
        exact = host.matching_pages(indices, host.hashes(tokens))
        conn.send(("read", hit, completed, exact))
        assert conn.recv() == "exit"
    finally:
        host.close()
        dist.destroy_process_group()
        conn.close()
