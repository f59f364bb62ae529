"""How the framework runs one tier: the manager's per-tier options."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.tiering.backpressure import BackpressureSettings
from kvtier.tiering.runner import RunnerSettings

__all__ = ["TierOptions"]


@dataclass(frozen=True)
class TierOptions:
    """How the framework runs one tier."""

    runner: RunnerSettings = field(default_factory=RunnerSettings)
    #: None: back-pressure is off for this tier.
    backpressure: BackpressureSettings | None = None
