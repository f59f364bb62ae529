"""The tier contract, run against a plugin whose I/O threads outlive its jobs.

``LateThreadTier`` (tests/late_tier.py) copies chunks in threads it does not wait for
when the framework cancels a job that timed out: the framework alone must keep such a
thread from writing into, or reading from, a slot that another chunk took meanwhile.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
from late_tier import LateThreadTier

from kvtier import KVTier
from kvtier.keys import OffloadKey
from kvtier.testing import Stall, TierContract


def late_tier(node: KVTier) -> LateThreadTier:
    tier = node.manager.tiers[0]
    assert isinstance(tier, LateThreadTier)
    return tier


class TestLateThreadPluginContract(TierContract):
    clears = False  # the plugin has no clear(): it keeps its chunks

    async def tier_config(self) -> Mapping[str, Any]:
        return {"type": "LateThreadTier", "module_path": "late_tier"}

    async def corrupt(self, writer: KVTier, key: OffloadKey) -> None:
        pytest.skip("the plugin keeps chunks as bytes in this process: nothing to damage")

    async def truncate(self, writer: KVTier, key: OffloadKey) -> None:
        pytest.skip("the plugin keeps chunks as bytes in this process: nothing to damage")

    async def stored_chunk(self, writer: KVTier, key: OffloadKey) -> bytes | None:
        return late_tier(writer).stored(key)

    @contextlib.asynccontextmanager
    async def stall_loads(self, node: KVTier, key: OffloadKey) -> AsyncIterator[Stall]:
        with late_tier(node).hold_next("load") as stall:
            yield stall

    @contextlib.asynccontextmanager
    async def stall_stores(self, node: KVTier) -> AsyncIterator[Stall]:
        with late_tier(node).hold_next("store") as stall:
            yield stall
