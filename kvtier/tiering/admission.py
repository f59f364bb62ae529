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

What a wait may cost: once the host's cost is known, a request waits for its promoted
chunks no longer than recomputing them would take, and for chunks of a tier not
measured yet no longer than :data:`EXPLORE_SHARE` of that. Such a promotion is a probe
whose cost nobody knows: should the tier have become a slow link, the request gives up
early and recomputes, and the job, which goes on, measures the tier for the requests
after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtier.keys import OffloadKey

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
# What a request may lose to a promotion from a tier not measured yet: this share of
# the time recomputing its chunks takes. A healthy tier promotes in a small part of
# that (a disk read of a chunk against a prefill of it), so the probe is rarely cut
# short, and one that is measures the tier anyway.
EXPLORE_SHARE = 0.1


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

    def wait_allowance(self, tier: int) -> float | None:
        """How long a request may wait for one more chunk promoted from ``tier``:
        recomputing it, or :data:`EXPLORE_SHARE` of that while the tier is not measured;
        None while the host's cost is unknown (no bound)."""
        recompute = self.recompute_s_per_chunk
        if recompute is None:
            return None
        return recompute if self.weighs(tier) else EXPLORE_SHARE * recompute

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
    for longer than its limit since the first such answer, or that the host gave up on
    (:meth:`expire`), is *expired*: its pending keys are misses from then on, and the
    host recomputes them instead of waiting. The limit is ``max_pending_s``, or what the
    request's promotions allow (:meth:`allow`: the sum of their chunks' allowances,
    :meth:`PromotionCosts.wait_allowance`) when that is less.
    """

    def __init__(self, max_pending_s: float | None = None) -> None:
        self.max_pending_s = max_pending_s
        self._since: dict[str, float] = {}
        #: Per request: the keys whose wait was allowed, and the sum of the allowances.
        self._allowed_keys: dict[str, set[OffloadKey]] = {}
        self._allowed: dict[str, float] = {}
        self._expired: set[str] = set()

    def allowed(self, req_id: str, key: OffloadKey) -> bool:
        """Whether the wait for ``key`` already counts in the request's limit."""
        keys = self._allowed_keys.get(req_id)
        return keys is not None and key in keys

    def allow(self, req_id: str, key: OffloadKey, seconds: float | None) -> None:
        """The request waits for ``key``'s promotion, worth waiting ``seconds`` for
        (None: no bound of its own); counted once per key. The request's clock starts
        with its first allowance."""
        if seconds is None or self.allowed(req_id, key):
            return
        keys = self._allowed_keys.get(req_id)
        if keys is None:
            keys = self._allowed_keys[req_id] = set()
            self._since.setdefault(req_id, time.perf_counter())
        keys.add(key)
        self._allowed[req_id] = self._allowed.get(req_id, 0.0) + seconds

    def _limit(self, req_id: str) -> float | None:
        limit, allowed = self.max_pending_s, self._allowed.get(req_id)
        if allowed is None:
            return limit
        return allowed if limit is None else min(limit, allowed)

    def expired(self, req_id: str) -> bool:
        """Whether the request's pending keys are misses now; the first call for a
        request with a limit starts its clock. Reads the clock only then: the lookup
        path calls this for every key that is not readable."""
        if req_id in self._expired:
            return True
        limit = self._limit(req_id)
        if limit is None:
            return False
        now = time.perf_counter()
        since = self._since.setdefault(req_id, now)
        if now - since <= limit:
            return False
        self._expired.add(req_id)
        return True

    def remaining_s(self, req_id: str) -> float | None:
        """Seconds before the request's pending keys become misses: 0 once expired,
        None while it has no limit or its clock has not started."""
        if req_id in self._expired:
            return 0.0
        limit, since = self._limit(req_id), self._since.get(req_id)
        if limit is None or since is None:
            return None
        return max(0.0, limit - (time.perf_counter() - since))

    def is_expired(self, req_id: str) -> bool:
        return req_id in self._expired

    def expire(self, req_id: str) -> None:
        self._expired.add(req_id)

    def forget(self, req_id: str) -> None:
        self._since.pop(req_id, None)
        self._allowed.pop(req_id, None)
        self._allowed_keys.pop(req_id, None)
        self._expired.discard(req_id)

    def clear(self) -> None:
        self._since.clear()
        self._allowed.clear()
        self._allowed_keys.clear()
        self._expired.clear()
