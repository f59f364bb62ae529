"""kvtier: asyncio-native multi-tier KV-cache offloading for LLM serving engines.

The names below are the public contract; everything else may move between releases.

Each name is imported the first time it is used (``kvtier.KVTier``, ``from kvtier
import KVTier``), not when the package is: the ``kvtier`` command and the light
submodules (``kvtier.config``, ``kvtier.cli``) start without torch, which the facade,
the region and the tiering manager need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier._lazy import lazy_names

if TYPE_CHECKING:
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
    from kvtier.tiers import (
        JobResult,
        SecondaryTier,
        SecondaryTierFactory,
        TierContext,
        TransferJob,
    )

__version__ = "0.1.0"

#: Where each public name lives: the module imported when the name is first used.
_HOMES = {
    "CPUOffloadingSpec": "kvtier.specs",
    "CachePolicy": "kvtier.policies",
    "CachePolicyFactory": "kvtier.policies",
    "ConfigError": "kvtier.errors",
    "JobResult": "kvtier.tiers",
    "KVTier": "kvtier.facade",
    "LookupResult": "kvtier.records",
    "Medium": "kvtier.records",
    "OffloadKey": "kvtier.keys",
    "OffloadingConfig": "kvtier.config",
    "OffloadingEvent": "kvtier.records",
    "OffloadingSpec": "kvtier.specs",
    "OffloadingSpecFactory": "kvtier.specs",
    "ReqContext": "kvtier.records",
    "ScheduleEndContext": "kvtier.records",
    "SecondaryTier": "kvtier.tiers",
    "SecondaryTierFactory": "kvtier.tiers",
    "SharedOffloadRegion": "kvtier.region",
    "TierContext": "kvtier.tiers",
    "TieringOffloadingManager": "kvtier.tiering",
    "TieringOffloadingSpec": "kvtier.specs",
    "TransferJob": "kvtier.tiers",
    "key_block_hash": "kvtier.keys",
    "key_group_idx": "kvtier.keys",
    "make_offload_key": "kvtier.keys",
    "prefix_keys": "kvtier.keys",
}

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


__getattr__, __dir__ = lazy_names(__name__, _HOMES, __all__)
