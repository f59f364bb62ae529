"""kvtier: asyncio-native multi-tier KV-cache offloading for LLM serving engines.

The names below are the public contract; everything else may move between releases.
"""

from kvtier.config import OffloadingConfig
from kvtier.errors import ConfigError
from kvtier.facade import KVTier
from kvtier.keys import (
    OffloadKey,
    key_block_hash,
    key_group_idx,
    make_offload_key,
    prefix_keys,
)
from kvtier.policies import CachePolicy, CachePolicyFactory
from kvtier.records import (
    LookupResult,
    Medium,
    OffloadingEvent,
    ReqContext,
    ScheduleEndContext,
)
from kvtier.region import SharedOffloadRegion
from kvtier.specs import (
    CPUOffloadingSpec,
    OffloadingSpec,
    OffloadingSpecFactory,
    TieringOffloadingSpec,
)
from kvtier.tiering import TieringOffloadingManager
from kvtier.tiers import JobResult, SecondaryTier, SecondaryTierFactory, TierContext, TransferJob

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadingSpec",
    "CachePolicy",
    "CachePolicyFactory",
    "ConfigError",
    "JobResult",
    "KVTier",
    "LookupResult",
    "Medium",
    "OffloadKey",
    "OffloadingConfig",
    "OffloadingEvent",
    "OffloadingSpec",
    "OffloadingSpecFactory",
    "ReqContext",
    "ScheduleEndContext",
    "SecondaryTier",
    "SecondaryTierFactory",
    "SharedOffloadRegion",
    "TierContext",
    "TieringOffloadingManager",
    "TieringOffloadingSpec",
    "TransferJob",
    "key_block_hash",
    "key_group_idx",
    "make_offload_key",
    "prefix_keys",
]
