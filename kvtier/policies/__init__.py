"""Eviction policies of the primary tier: ``lru``, ``arc`` and out-of-tree ones."""

from kvtier.policies.arc import ARCCachePolicy
from kvtier.policies.base import CachePolicy
from kvtier.policies.factory import CachePolicyFactory
from kvtier.policies.lru import LRUCachePolicy

__all__ = ["ARCCachePolicy", "CachePolicy", "CachePolicyFactory", "LRUCachePolicy"]
