"""What one bench run is asked to do, and the engine configuration it gives."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config import OffloadingConfig
from kvtier.specs.factory import with_spec_name

__all__ = ["MIB", "TOKENS_PER_BLOCK", "BenchSettings", "bench_config"]

MIB = 1 << 20
#: Tokens per GPU block of the simulated engine (vLLM's default); a chunk is one block
#: unless ``--config`` sets ``block_size``.
TOKENS_PER_BLOCK = 16


@dataclass
class BenchSettings:
    workload: str = "multi-round-qa"
    #: Registered bench tier names (``--tiers``), in lookup order.
    tiers: tuple[str, ...] = ("fs",)
    #: Extra ``extra_config`` keys (``--config FILE``), applied over the defaults.
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    chunk_bytes: int = 1 * MIB
    primary_bytes: int = 512 * MIB
    working_set_bytes: int = 2048 * MIB
    max_prompt_chunks: int = 64
    concurrency: int = 8
    duration_s: float = 120.0
    lookup_timeout_s: float = 5.0
    #: The working directory (the fs tier, the local S3 server's data); None: a
    #: temporary one. It must be new or empty unless ``reuse_root``.
    root_dir: Path | None = None
    #: Start from what an earlier run left in ``root_dir`` (its cache: more hits).
    reuse_root: bool = False
    seed: int = 0

    @property
    def working_set_chunks(self) -> int:
        return max(1, self.working_set_bytes // self.chunk_bytes)


def bench_config(
    settings: BenchSettings, tiers: list[dict[str, Any]], *, role: str = "bench"
) -> OffloadingConfig:
    """The engine's configuration: ``tiers`` as its secondary tiers, then ``--config``,
    its spec named as ``kvtier plan`` names a file's (``with_spec_name``)."""
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": settings.primary_bytes,
        "secondary_tiers": tiers,
    }
    extra.update(settings.extra_config)
    return OffloadingConfig(
        engine_id=f"{role}-{uuid.uuid4().hex[:10]}",
        kv_bytes_per_block=settings.chunk_bytes,
        tokens_per_block=TOKENS_PER_BLOCK,
        model_name="kvtier-bench",
        kv_dtype="int64",
        extra_config=with_spec_name(extra),
    )
