"""The tier contract, run against the example tier (the model for plugin authors).

The example tier keeps chunks as bytes in memory and copies them on the event loop:
there is nothing to damage and no I/O to stall, so those tests are skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from kvtier import KVTier
from kvtier.keys import OffloadKey
from kvtier.testing import Stall, TierContract

IN_MEMORY = "the example tier keeps chunks as bytes in this process: nothing to damage"
ON_THE_LOOP = "the example tier copies on the event loop: no I/O to hold up"


class TestExampleTierContract(TierContract):
    async def tier_config(self) -> Mapping[str, Any]:
        return {"type": "example"}

    async def corrupt(self, writer: KVTier, key: OffloadKey) -> None:
        pytest.skip(IN_MEMORY)

    async def truncate(self, writer: KVTier, key: OffloadKey) -> None:
        pytest.skip(IN_MEMORY)

    def stall_loads(self, node: KVTier, key: OffloadKey) -> AbstractAsyncContextManager[Stall]:
        pytest.skip(ON_THE_LOOP)

    def stall_stores(self, node: KVTier) -> AbstractAsyncContextManager[Stall]:
        pytest.skip(ON_THE_LOOP)
