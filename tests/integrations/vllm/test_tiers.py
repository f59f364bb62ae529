"""kvtier's tiers as vLLM sees them: the medium, locality and hit source each declares."""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import pytest
from vllm.v1.kv_offload import base as vllm_base
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.integrations.vllm_tiers import TierDescriptions, VllmTier
from kvtier.records import HitSource, Medium
from kvtier.tiers.example import ExampleTier
from kvtier.tiers.fs import FileSystemTier
from kvtier.tiers.memcached import MemcachedTier
from kvtier.tiers.p2p import PeerTier
from kvtier.tiers.s3 import S3Tier

CPU, STORAGE = vllm_base.Medium.CPU, vllm_base.Medium.STORAGE
LOCAL, REMOTE = vllm_base.Locality.LOCAL, vllm_base.Locality.REMOTE


def parsed(label: str = "1:t", locality: str = "local") -> SimpleNamespace:
    """What the adapter reads of a tier's TierConfig."""
    return SimpleNamespace(label=label, locality=locality)


@pytest.mark.parametrize(
    ("tier_class", "expected"),
    [
        (ExampleTier, VllmTier(CPU, LOCAL, CacheHitSource.HOST)),
        (FileSystemTier, VllmTier(STORAGE, LOCAL, CacheHitSource.DISK)),
        (S3Tier, VllmTier(STORAGE, REMOTE, CacheHitSource.DISK)),
        (PeerTier, VllmTier(CPU, REMOTE, CacheHitSource.P2P)),
        (MemcachedTier, VllmTier(CPU, REMOTE, CacheHitSource.EXTERNAL_UNSPECIFIED)),
    ],
)
def test_each_built_in_tier_is_seen_as_it_declares_itself(tier_class, expected):
    assert VllmTier.of(tier_class, parsed(locality=tier_class.locality)) == expected


def test_remote_memory_is_remote_whatever_locality_the_configuration_gives():
    assert VllmTier.of(MemcachedTier, parsed(locality="local")).locality is REMOTE


def test_the_hit_source_a_tier_declares_wins_over_its_medium():
    class RemoteDisk(FileSystemTier):
        hit_source: ClassVar[HitSource] = HitSource.EXTERNAL

    assert RemoteDisk.medium is Medium.STORAGE
    assert VllmTier.of(RemoteDisk, parsed()).source is CacheHitSource.EXTERNAL_UNSPECIFIED


def test_a_load_filter_keeps_the_tiers_it_matches_and_sources_follow_labels():
    tiers = TierDescriptions(
        [ExampleTier, MemcachedTier],  # type: ignore[list-item]
        [parsed("1:example"), parsed("2:memcached", "remote")],  # type: ignore[list-item]
    )
    local_memory = vllm_base.TierFilter(matchers=(vllm_base.TierMatcher(CPU, LOCAL),))
    assert tiers.load_tiers(local_memory) == frozenset({"1:example"})
    assert tiers.load_tiers(vllm_base.TierFilter.ALL) is None
    assert tiers.hit_source(None) is CacheHitSource.HOST
    assert tiers.hit_source("2:memcached") is CacheHitSource.EXTERNAL_UNSPECIFIED
