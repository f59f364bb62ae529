"""Secondary tiers: the interface, the factory and the built-in tiers.

A tier subclasses :class:`SecondaryTier`, declares where it keeps its bytes
(:class:`~kvtier.records.Medium`) and, where the medium does not say it, where a host
should report its hits as coming from (:class:`~kvtier.records.HitSource`).
:mod:`kvtier.tiers.kit` holds what every real tier needs besides its own I/O;
:mod:`kvtier.tiers.memcached` is the model of a tier that talks to a server.
"""

from kvtier.records import HitSource, Locality, Medium
from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob
from kvtier.tiers.factory import SecondaryTierFactory

__all__ = [
    "HitSource",
    "JobResult",
    "Locality",
    "Medium",
    "SecondaryTier",
    "SecondaryTierFactory",
    "TierContext",
    "TransferJob",
]
