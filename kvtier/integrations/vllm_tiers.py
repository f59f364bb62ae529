"""kvtier's tiers as vLLM sees them: medium, locality and hit source, by tier label.

vLLM's connector filters the tiers a request may load from by medium and locality
(``kv_load_tiers``), labels each event with a medium and a locality, and splits hits by
the ``CacheHitSource`` of the tier each chunk came from. A kvtier tier declares its own
:class:`~kvtier.records.Medium` and :class:`~kvtier.records.HitSource`; this module
translates them, and the locality the spec parsed for the tier, into vLLM's terms.
Used by :mod:`kvtier.integrations.vllm` only: it imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm.v1.kv_offload import base as vllm_base
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.records import HitSource, Locality, Medium, OffloadingEvent
from kvtier.specs.settings import TierConfig
from kvtier.tiers.base import SecondaryTier

__all__ = ["TierDescriptions", "VllmTier"]

# vLLM knows two media. Memory of another engine or of a memory server is memory: CPU,
# and remote whatever the tier's locality says.
_MEDIUM = {
    Medium.CPU: (vllm_base.Medium.CPU, None),
    Medium.GPU: (vllm_base.Medium.CPU, None),
    Medium.STORAGE: (vllm_base.Medium.STORAGE, None),
    Medium.NETWORK: (vllm_base.Medium.CPU, vllm_base.Locality.REMOTE),
    Medium.REMOTE_MEMORY: (vllm_base.Medium.CPU, vllm_base.Locality.REMOTE),
}
_LOCALITY = {
    Locality.LOCAL: vllm_base.Locality.LOCAL,
    Locality.REMOTE: vllm_base.Locality.REMOTE,
}
_SOURCE = {
    HitSource.HOST: CacheHitSource.HOST,
    HitSource.P2P: CacheHitSource.P2P,
    HitSource.DISK: CacheHitSource.DISK,
    HitSource.EXTERNAL: CacheHitSource.EXTERNAL_UNSPECIFIED,
}


@dataclass(frozen=True)
class VllmTier:
    """One tier in vLLM's terms."""

    medium: vllm_base.Medium
    locality: vllm_base.Locality
    source: CacheHitSource

    @classmethod
    def of(cls, tier: SecondaryTier, config: TierConfig) -> VllmTier:
        """``tier``, built from ``config``: its medium and hit source as it declares
        them, its locality as the spec parsed it (given, else the tier class's: the one
        that also chose its back-pressure water marks)."""
        medium, locality = _MEDIUM[tier.medium]
        return cls(medium, locality or _LOCALITY[config.locality], _SOURCE[tier.hit_source])


class TierDescriptions:
    """Every secondary tier of a manager in vLLM's terms, by label."""

    def __init__(self, tiers: Sequence[SecondaryTier], configs: Sequence[TierConfig]) -> None:
        self.by_label = {
            config.label: VllmTier.of(tier, config)
            for tier, config in zip(tiers, configs, strict=True)
        }

    def load_tiers(self, load_filter: vllm_base.TierFilter) -> frozenset[str] | None:
        """The labels of the tiers ``load_filter`` lets a request load from; None: all."""
        if load_filter is vllm_base.TierFilter.ALL:
            return None
        return frozenset(
            label
            for label, tier in self.by_label.items()
            if load_filter.allows(tier.medium, tier.locality)
        )

    def hit_source(self, label: str | None) -> CacheHitSource:
        """Where a chunk promoted from the tier ``label`` came from (None: the primary
        tier, host memory)."""
        if label is None:
            return CacheHitSource.HOST
        tier = self.by_label.get(label)
        return CacheHitSource.EXTERNAL_UNSPECIFIED if tier is None else tier.source

    def event(self, event: OffloadingEvent) -> vllm_base.OffloadingEvent:
        """``event`` as vLLM's: the primary tier's local and unowned, a secondary tier's
        owned by its label."""
        tier = self.by_label.get(event.tier)
        if tier is None:  # the primary tier
            medium, locality, ownership = _MEDIUM[event.medium][0], vllm_base.Locality.LOCAL, None
        else:
            medium, locality, ownership = tier.medium, tier.locality, event.tier
        return vllm_base.OffloadingEvent(
            keys=list(event.keys),
            medium=medium,
            removed=event.removed,
            locality=locality,
            ownership=ownership,
            # Every kvtier tier announces what it evicts.
            removal_expected=not event.removed,
        )
