"""Secondary tiers: the interface, the factory and the built-in tiers."""

from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob
from kvtier.tiers.factory import SecondaryTierFactory

__all__ = ["JobResult", "SecondaryTier", "SecondaryTierFactory", "TierContext", "TransferJob"]
