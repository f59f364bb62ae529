"""benchmarks/loop_stalls.py: a stall of the event loop is caught where it happened."""

from __future__ import annotations

import asyncio
import time

from loop_stalls import Watchdog


def block_the_loop() -> None:
    time.sleep(0.08)  # the loop's thread does this work itself


def test_a_callback_that_blocks_the_loop_is_named_as_the_stall():
    watchdog = Watchdog(stall_s=0.02)

    async def run() -> None:
        watchdog.start(asyncio.get_running_loop())
        await asyncio.sleep(0.01)
        block_the_loop()
        await asyncio.sleep(0.01)
        watchdog.stop()

    asyncio.run(run())
    places = {leaf + " < " + above for leaf, above in watchdog.stalls}
    assert any("block_the_loop" in place for place in places), places
    assert watchdog.beats > 0
