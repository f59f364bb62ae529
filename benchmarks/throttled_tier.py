"""An fs tier behind a slow link: a secondary tier that is there but degraded.

Loads read the chunk files as the fs tier does, then hold the job until the bytes
would have crossed a link of ``load_mb_s`` megabytes per second shared by every
load of the tier (one job's bytes after another's), plus ``load_latency_ms`` per
job: a remote store behind a congested network, a disk shared with a busy
neighbour. Stores are not slowed (what a degraded link costs a request is the wait
for its loads). A plugin tier, configured as::

    {"type": "ThrottledFsTier", "module_path": "throttled_tier",
     "root_dir": "...", "load_mb_s": 20}

with ``benchmarks/`` on ``sys.path``; every other key is the fs tier's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import anyio

from kvtier.config import ConfigReader
from kvtier.tiers.base import JobResult, TierContext, TransferJob
from kvtier.tiers.fs import FileSystemTier

__all__ = ["ThrottledFsTier", "throttled_fs_config"]


def throttled_fs_config(root_dir: str, load_mb_s: float, load_latency_ms: float = 0.0) -> dict:
    """The tier's entry of ``secondary_tiers``."""
    return {
        "type": "ThrottledFsTier",
        "module_path": "throttled_tier",
        "root_dir": root_dir,
        "load_mb_s": load_mb_s,
        "load_latency_ms": load_latency_ms,
    }


class ThrottledFsTier(FileSystemTier):
    """The fs tier, its loads paced to ``load_mb_s`` plus ``load_latency_ms`` per job."""

    @classmethod
    def check_params(cls, params: Mapping[str, Any], path: str) -> Any:
        _link(params, path)
        return super().check_params(_fs_params(params), path)

    def __init__(self, ctx: TierContext, **params: Any) -> None:
        load_mb_s, load_latency_ms = _link(params, ctx.config_path)
        super().__init__(ctx, **_fs_params(params))
        self._bytes_per_s = load_mb_s * 1e6
        self._latency_s = load_latency_ms / 1000
        #: When the link has carried every byte of the loads so far.
        self._link_free_at = 0.0

    async def load(self, job: TransferJob) -> JobResult:
        started = time.monotonic()
        result = await super().load(job)
        crossing = len(job.keys) * self.ctx.chunk_bytes / self._bytes_per_s
        self._link_free_at = max(self._link_free_at, started) + crossing
        await anyio.sleep(max(0.0, self._link_free_at + self._latency_s - time.monotonic()))
        return result


def _link(params: Mapping[str, Any], path: str) -> tuple[float, float]:
    reader = ConfigReader({k: params[k] for k in _LINK_KEYS if k in params}, path)
    load_mb_s = reader.number("load_mb_s", minimum=0, exclusive_minimum=True)
    return float(load_mb_s), float(reader.number("load_latency_ms", 0.0, minimum=0))


def _fs_params(params: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k not in _LINK_KEYS}


_LINK_KEYS = ("load_mb_s", "load_latency_ms")
