"""Load or recompute: whether a promotion would beat the host recomputing the chunk.

A secondary-tier hit is worth promoting only if the chunk reaches the primary tier
before the host could have recomputed it. The host says what recomputing costs
(seconds of prefill per chunk: ``recompute_s_per_chunk`` in the configuration, or
:meth:`~kvtier.tiering.host.HostAccess.set_recompute_cost` as it
measures); kvtier learns what a promotion costs from its own jobs. For a request asking
a tier for its n-th chunk of the step, the promotion's estimate is the tier's measured
seconds per chunk times the chunks ahead of it (in flight, and queued for the requests
whose turn comes before it, its own included: the queue serves requests in turn) plus
one; recomputing it costs the request's n chunks. A hit whose promotion would arrive
later is answered as a miss and counted.

Seconds per chunk are a moving average of finished promotion jobs (job time over the
chunks it moved; a job that timed out counts with its time-out). Until a tier has
finished a job there is nothing to go by, and its hits are promoted; so too once its
last finished job is older than :data:`STALE_AFTER_S`, since a tier that loses gets no
jobs that would notice it recover.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["PromotionCosts"]

# Weight of the newest job in the moving average: about the last five jobs count,
# so a tier that slows down (a throttled link, a busy disk) is noticed within a few
# requests, and one slow job does not turn a fast tier off.
_ALPHA = 0.3
# A tier found slower than recomputing gets no promotions, so nothing measures it again:
# a measurement this old is forgotten, and the tier's next hit is promoted and measured.
# A link that recovered is noticed within a minute; one that did not costs one request
# in a minute the wait for one promotion (bounded by the host's deadline).
STALE_AFTER_S = 60.0


class PromotionCosts:
    """Measured promotion cost per tier, and the host's recompute cost."""

    def __init__(
        self,
        tiers: int,
        recompute_s_per_chunk: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.recompute_s_per_chunk = recompute_s_per_chunk
        #: Seconds per chunk of each tier's promotion jobs; None before the first.
        self.per_chunk_s: list[float | None] = [None] * tiers
        self._measured_at = [0.0] * tiers
        self._clock = clock

    def job_done(self, tier: int, seconds: float, chunks: int) -> None:
        """A promotion job of ``tier`` moved ``chunks`` chunks in ``seconds``."""
        if chunks <= 0:
            return
        sample = seconds / chunks
        current = self.per_chunk_s[tier]
        self.per_chunk_s[tier] = (
            sample if current is None else current + _ALPHA * (sample - current)
        )
        self._measured_at[tier] = self._clock()

    def weighs(self, tier: int) -> bool:
        """Whether promotions from ``tier`` are weighed at all: the host gave its cost
        and the tier has finished a promotion job."""
        if self.recompute_s_per_chunk is None or self.per_chunk_s[tier] is None:
            return False
        if self._clock() - self._measured_at[tier] > STALE_AFTER_S:
            self.per_chunk_s[tier] = None
            return False
        return True

    def loses(self, tier: int, ahead: int, own: int) -> bool:
        """Whether promoting one more chunk from ``tier`` would take longer than
        recomputing it: ``ahead`` chunks are before it on the tier (the request's
        ``own`` among them, already promoted this step)."""
        recompute = self.recompute_s_per_chunk
        per_chunk = self.per_chunk_s[tier]
        if recompute is None or per_chunk is None:
            return False
        return (ahead + 1) * per_chunk > (own + 1) * recompute


class Deadlines:
    """How long a request's lookups may stay pending.

    A request whose lookups have answered "pending" (a promotion or lookup on its way)
    for longer than ``max_pending_s`` since the first such answer, or that the host gave
    up on (:meth:`expire`), is *expired*: its pending keys are misses from then on, and
    the host recomputes them instead of waiting.
    """

    def __init__(self, max_pending_s: float | None = None) -> None:
        self.max_pending_s = max_pending_s
        self._since: dict[str, float] = {}
        self._expired: set[str] = set()

    def expired(self, req_id: str) -> bool:
        """Whether the request's pending keys are misses now; the first call for a
        request starts its clock. Reads the clock only when ``max_pending_s`` is set:
        the lookup path calls this for every key that is not readable."""
        if req_id in self._expired:
            return True
        limit = self.max_pending_s
        if limit is None:
            return False
        now = time.perf_counter()
        since = self._since.setdefault(req_id, now)
        if now - since <= limit:
            return False
        self._expired.add(req_id)
        return True

    def is_expired(self, req_id: str) -> bool:
        return req_id in self._expired

    def expire(self, req_id: str) -> None:
        self._expired.add(req_id)

    def forget(self, req_id: str) -> None:
        self._since.pop(req_id, None)
        self._expired.discard(req_id)

    def clear(self) -> None:
        self._since.clear()
        self._expired.clear()
