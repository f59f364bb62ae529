"""A short randomized soak: requests, resets and cancellations never serve wrong bytes."""

from __future__ import annotations

import pytest
from soak import run_soak

pytestmark = pytest.mark.anyio


@pytest.mark.slow
async def test_a_randomized_soak_serves_no_wrong_byte_and_leaks_no_pin(tmp_path):
    report = await run_soak(tmp_path, duration_s=12, tasks=8, primary_chunks=40, seed=7)
    assert report.mismatches == 0
    assert report.pinned_at_end == 0
    # The soak really did what it is for.
    assert report.requests > 100 and report.cancelled > 5 and report.resets > 0
    assert report.chunks_loaded > 100 and report.chunks_stored > 100
