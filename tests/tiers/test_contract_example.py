"""The tier contract, run against the example tier (the smallest complete tier).

The example tier keeps each chunk framed (header, then row) as bytes in memory, so a
test damages it there; it copies on the event loop, with no I/O to stall, so those
tests are skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest
from helpers import damaged

from kvtier import KVTier
from kvtier.format import HEADER_BYTES
from kvtier.keys import OffloadKey
from kvtier.testing import Stall, TierContract
from kvtier.tiers.example import ExampleTier

ON_THE_LOOP = "the example tier copies on the event loop: no I/O to hold up"


def example_tier(node: KVTier) -> ExampleTier:
    tier = node.manager.tiers[0]
    assert isinstance(tier, ExampleTier)
    return tier


class TestExampleTierContract(TierContract):
    async def tier_config(self) -> Mapping[str, Any]:
        return {"type": "example"}

    async def corrupt(self, writer: KVTier, key: OffloadKey) -> None:
        chunks = example_tier(writer).chunks
        chunks[key] = damaged(chunks[key], "flip_payload")

    async def truncate(self, writer: KVTier, key: OffloadKey) -> None:
        chunks = example_tier(writer).chunks
        chunks[key] = damaged(chunks[key], "truncate")

    async def stored_chunk(self, writer: KVTier, key: OffloadKey) -> bytes | None:
        chunk = example_tier(writer).chunks.get(key)
        return None if chunk is None else chunk[HEADER_BYTES:]

    def stall_loads(self, node: KVTier, key: OffloadKey) -> AbstractAsyncContextManager[Stall]:
        pytest.skip(ON_THE_LOOP)

    def stall_stores(self, node: KVTier) -> AbstractAsyncContextManager[Stall]:
        pytest.skip(ON_THE_LOOP)
