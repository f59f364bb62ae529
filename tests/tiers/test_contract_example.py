"""The tier contract, run against the example tier (the model for plugin authors).

The example tier keeps chunks as bytes in memory and copies them on the event loop:
there is nothing to damage and no I/O to stall, so those tests are skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.testing import TierContract


class TestExampleTierContract(TierContract):
    async def tier_config(self) -> Mapping[str, Any]:
        return {"type": "example"}
