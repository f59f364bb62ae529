"""Back-pressure: drop cascades to a tier that cannot keep up.

Each cascade's latency, from submission to completion, is normalised to seconds per
MiB and folded into an exponential moving average. After ``warmup`` completions the
tier turns *pressured* when the average rises above ``high_water`` and stops being
pressured when it falls below ``low_water`` (hysteresis) and a further ``cooldown_s``
has passed, so a tier that just recovered is not flooded by the backlog at once. With
no completions the average decays towards zero with ``decay_half_life_s``, so a tier
whose cascades are all being dropped still recovers. A failed store counts as a sample
of three times the high mark; with a ``failure_threshold`` of n, failed stores feed no
sample and instead n of them in a row put the tier under pressure at once, even while
warming up (a full disk fails fast, so its latency says nothing), and a store that
succeeds starts the count again.

While pressured, the ``drop`` policy drops every cascade; ``throttled`` drops a share
that grows linearly from none at the high mark to all at three times the high mark.
Only cascades are ever dropped, never promotions, and each drop is counted.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.config import ConfigReader
from kvtier.errors import ConfigError
from kvtier.records import Locality

__all__ = ["DEFAULT_MARKS", "Backpressure", "BackpressurePolicy", "BackpressureSettings"]

_MIB = float(1 << 20)
# Stores smaller than this still count as this much: timer and scheduling noise would
# otherwise turn a 4 KiB store into a huge per-MiB latency.
_MIN_SAMPLE_MIB = 0.25
# Where failures in a row put the average: above the throttled policy's drop-all point
# (three times the high mark), so every cascade is dropped until idle decay lets one
# through to probe the tier.
_FAILURE_EMA_FACTOR = 4.0

#: Water marks (s/MiB) by locality: a local NVMe writes 1 MiB in well under 1 ms; 5 ms
#: per MiB (200 MB/s) means it is saturated. Remote stores have more latency per MiB.
DEFAULT_MARKS = {Locality.LOCAL: (0.005, 0.001), Locality.REMOTE: (0.020, 0.005)}


class BackpressurePolicy(str, enum.Enum):
    """What a pressured tier's cascades meet (the module's docstring says how)."""

    THROTTLED = "throttled"
    DROP = "drop"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class BackpressureSettings:
    """One tier's back-pressure; each field's default is the setting's default.

    The water marks default by locality (:data:`DEFAULT_MARKS`): a local tier's here.
    """

    policy: BackpressurePolicy = BackpressurePolicy.THROTTLED
    high_water: float = DEFAULT_MARKS[Locality.LOCAL][0]
    low_water: float = DEFAULT_MARKS[Locality.LOCAL][1]
    alpha: float = 0.3
    warmup: int = 3
    decay_half_life_s: float = 2.0
    cooldown_s: float = 1.0
    #: Failed stores in a row that put the tier under pressure; None: each failed
    #: store is a slow sample instead (the module's docstring says how).
    failure_threshold: int | None = None

    @classmethod
    def parse(
        cls,
        raw: Mapping[str, Any],
        path: str,
        locality: Locality,
        *,
        check_marks: bool = True,
    ) -> BackpressureSettings:
        """Read a merged ``backpressure`` mapping; water marks default by ``locality``.

        ``check_marks=False`` checks each value alone, for the top-level defaults, whose
        marks are only compared once merged under a tier's own.

        Raises:
            ConfigError: a value is invalid or the low mark is above the high mark.
        """
        high_default, low_default = DEFAULT_MARKS[locality]
        default = cls()
        reader = ConfigReader(raw, path)
        settings = cls(
            policy=reader.choice("policy", BackpressurePolicy, default.policy),
            high_water=reader.number("high_water", high_default, minimum=0, exclusive_minimum=True),
            low_water=reader.number("low_water", low_default, minimum=0),
            alpha=reader.number(
                "alpha", default.alpha, minimum=0, maximum=1, exclusive_minimum=True
            ),
            warmup=reader.integer("warmup", default.warmup, minimum=0),
            decay_half_life_s=reader.number(
                "decay_half_life_s", default.decay_half_life_s, minimum=0, exclusive_minimum=True
            ),
            cooldown_s=reader.number("cooldown_s", default.cooldown_s, minimum=0),
            failure_threshold=reader.integer("failure_threshold", None, minimum=1),
        )
        reader.reject_unknown()
        if check_marks and settings.low_water > settings.high_water:
            raise ConfigError(
                f"{path}.low_water",
                f"must not exceed high_water ({settings.low_water} > {settings.high_water})",
            )
        return settings


class Backpressure:
    """The pressure state of one tier. Not thread-safe: the manager owns it."""

    def __init__(
        self, settings: BackpressureSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self._clock = clock
        self.ema = 0.0
        self.completions = 0
        self.pressured = False
        self._below_low_since: float | None = None
        self._last_sample: float | None = None
        self._drop_debt = 0.0
        self.stores_dropped = 0
        self.chunks_dropped = 0
        #: Failed stores since the last one that succeeded (with a failure_threshold).
        self.failures_in_a_row = 0
        self._failure_tripped = False

    def record(self, elapsed_s: float, nbytes: int, *, failed: bool = False) -> None:
        """Fold in one finished cascade."""
        now = self._clock()
        self._decay(now)
        if self.settings.failure_threshold is not None:
            if failed:
                self._count_failure(now)
                return
            self.failures_in_a_row = 0
        sample = elapsed_s / max(nbytes / _MIB, _MIN_SAMPLE_MIB)
        if failed:
            sample = max(sample, 3 * self.settings.high_water)
        alpha = self.settings.alpha
        self.ema = alpha * sample + (1 - alpha) * self.ema
        self.completions += 1
        self._last_sample = now
        self._judge(now)

    def _count_failure(self, now: float) -> None:
        threshold = self.settings.failure_threshold
        self.failures_in_a_row += 1
        if threshold is None or self.failures_in_a_row < threshold:
            return
        self.ema = max(self.ema, _FAILURE_EMA_FACTOR * self.settings.high_water)
        self._last_sample = now
        self.pressured = self._failure_tripped = True
        self._below_low_since = None

    def admit(self, chunks: int) -> bool:
        """Whether a cascade of ``chunks`` chunks may go to the tier now (counts drops)."""
        now = self._clock()
        self._decay(now)
        self._judge(now)
        if not self.pressured or not self._drops(self._drop_share()):
            return True
        self.stores_dropped += 1
        self.chunks_dropped += chunks
        return False

    def reset(self) -> None:
        """Forget every sample and judgement, as a new tier would start (the cache was
        reset: what the tier met before says nothing of the traffic after). Drops not
        reported yet stay counted."""
        self.ema = 0.0
        self.completions = 0
        self.pressured = False
        self._below_low_since = None
        self._last_sample = None
        self._drop_debt = 0.0
        self.failures_in_a_row = 0
        self._failure_tripped = False

    def take_dropped(self) -> tuple[int, int]:
        """Stores and chunks dropped since the last call."""
        dropped = (self.stores_dropped, self.chunks_dropped)
        self.stores_dropped = self.chunks_dropped = 0
        return dropped

    def _drop_share(self) -> float:
        if self.settings.policy is BackpressurePolicy.DROP:
            return 1.0
        high = self.settings.high_water
        return min(max((self.ema - high) / (2 * high), 0.0), 1.0)

    def _drops(self, share: float) -> bool:
        # Deterministic thinning: drop whenever the accumulated share reaches a whole
        # store, so a share of 0.25 drops exactly every fourth cascade.
        self._drop_debt += share
        if self._drop_debt >= 1.0 - 1e-9:
            self._drop_debt -= 1.0
            return True
        return False

    def _decay(self, now: float) -> None:
        if self._last_sample is None or self.ema == 0.0:
            return
        idle = now - self._last_sample
        if idle > 0:
            self.ema *= 0.5 ** (idle / self.settings.decay_half_life_s)
            self._last_sample = now

    def _judge(self, now: float) -> None:
        settings = self.settings
        if self.completions < settings.warmup and not self._failure_tripped:
            return
        if self.ema > settings.high_water:
            self.pressured = True
            self._below_low_since = None
        elif self.pressured and self.ema < settings.low_water:
            if self._below_low_since is None:
                self._below_low_since = now
            if now - self._below_low_since >= settings.cooldown_s:
                self.pressured = self._failure_tripped = False
                self._below_low_since = None
                self._drop_debt = 0.0
