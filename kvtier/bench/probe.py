"""Measuring the event loop's responsiveness, and percentiles of what was measured."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

__all__ = ["LagProbe", "percentile"]


def percentile(values: Sequence[float], share: float) -> float:
    """The ``share`` quantile of ``values`` (nearest rank; 0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


class LagProbe:
    """How late a 1 ms timer fires: what a stalled event loop does to every task on it.

    Lags are recorded under the current :attr:`phase` (nothing while it is None), so a
    benchmark can tell its phases apart; :attr:`lags` holds the default phase's.
    """

    DEFAULT = "run"

    def __init__(self) -> None:
        self.by_phase: dict[str, list[float]] = {}
        self.phase: str | None = self.DEFAULT
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def lags(self) -> list[float]:
        return self.by_phase.get(self.DEFAULT, [])

    def start(self) -> None:
        self._stop.clear()
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            phase = self.phase
            start = loop.time()
            await asyncio.sleep(0.001)
            if phase is not None and phase == self.phase:
                self.by_phase.setdefault(phase, []).append(loop.time() - start - 0.001)
