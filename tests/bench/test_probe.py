"""The loop-lag probe: how late its timer fires, at the interval it was given."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtier.bench.probe import LagProbe


def block_the_loop() -> None:
    time.sleep(0.1)  # the loop's own thread does this work itself


def test_a_probe_at_a_longer_interval_still_sees_a_stalled_loop():
    probe = LagProbe(interval_s=0.01)

    async def run() -> None:
        probe.start()
        await asyncio.sleep(0.03)
        block_the_loop()
        await asyncio.sleep(0.03)
        await probe.stop()

    asyncio.run(run())
    assert probe.interval_s == 0.01
    # Ticks far fewer than a 1 ms probe's over the same ~0.17 s, and one of them waited
    # out most of the stall beyond its own 10 ms.
    assert 2 <= len(probe.lags) <= 20, probe.lags
    assert max(probe.lags) >= 0.05, probe.lags


def test_a_probe_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s must be positive, got 0"):
        LagProbe(interval_s=0)
