"""One record per request: everything the tiering core knows of a request, in one place.

A request's state used to be spread over the modules that acted on it; here it is one
:class:`Request`, owned by the :class:`RequestTable`, which is the only code that
creates or drops one. The promotion queues read and write a record's turn and sources,
the lookup answers live in it, and so does its deadline:

- its **turn** in the promotion queues, from its first queued promotion until it
  finishes (:mod:`~kvtier.tiering.promotions`);
- its **sources**: the tier each key promoted for it came from;
- each tier's **answers** for it, kept until it finishes, so that it sees one
  consistent answer while its promotions run;
- its **deadline**: how long its lookups may stay pending (``max_pending_s``, or what
  its promotions are worth waiting for once the host's recompute cost is known), and
  whether it has **expired**;
- its **pending** work (stores and promotions in flight), and whether it has
  **finished**: tiers hear that a request finished only once none of its work is in
  flight, since a tier that forgets a request on "finished" must not see its work
  afterwards;
- the keys whose lookup each tier **counted** for it: a tier's ``chunk_queries`` and
  ``chunk_hits`` count each key once per request, and no more once the request was
  **scheduled** (vLLM's meaning: a scheduler asks again every step a request waits,
  and a running request's lookups after a preemption are not a cache's hit ratio).

Ending a request is one call, :meth:`RequestTable.finish`, plus one release of the
slots it holds in the slot ledger. Everything here runs under the manager's lock.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvtier.keys import OffloadKey

__all__ = ["PRIMARY", "Request", "RequestTable"]

#: The primary tier's index in :attr:`Request.counted` (secondary tiers count from 0).
PRIMARY = -1


@dataclass(slots=True, eq=False)
class Request:
    """What the tiering core knows of one request."""

    req_id: str
    #: Its turn in the promotion queues (lower is served first); None until it queues one.
    turn: int | None = None
    #: The index of the tier each key promoted for it came from.
    sources: dict[OffloadKey, int] = field(default_factory=dict)
    #: Each tier's answers for it, by tier index, then key: whether the tier holds it.
    answers: dict[int, dict[OffloadKey, bool]] = field(default_factory=dict)
    #: When its deadline's clock started (its first pending answer or allowance).
    since: float | None = None
    #: Keys whose wait counts in its limit; None before the first allowance.
    allowed: set[OffloadKey] | None = None
    #: The sum of those keys' allowances, in seconds.
    allowance_s: float = 0.0
    #: Its pending keys are misses from now on.
    expired: bool = False
    #: Stores and promotions of the request in flight.
    pending: int = 0
    #: The host said it finished; the record goes once its pending work has ended.
    finished: bool = False
    #: The keys each tier counted a lookup of for it, by tier index (:data:`PRIMARY`
    #: for the primary tier); None once it was scheduled: it counts nothing more.
    counted: dict[int, set[OffloadKey]] | None = field(default_factory=dict)
    #: The keys it found readable in the primary tier and has not pinned since: a
    #: promotion it starts never evicts one of them, so a prefix found key by key is
    #: still there when the request pins it for its load.
    found: set[OffloadKey] = field(default_factory=set)

    def counts_answer(self, tier: int, key: OffloadKey) -> bool:
        """Whether ``tier``'s answer for ``key`` is counted for the request: its first
        answer for the key, while the request waits to be scheduled. Marks it counted."""
        counted = self.counted
        if counted is None:
            return False
        keys = counted.get(tier)
        if keys is None:
            counted[tier] = {key}
            return True
        if key in keys:
            return False
        keys.add(key)
        return True

    def forget_waits(self) -> None:
        """Drop what ties the request to the promotion queues and its deadline."""
        self.turn = None
        self.sources = {}
        self.since = None
        self.allowed = None
        self.allowance_s = 0.0
        self.expired = False


class RequestTable:
    """Every request the tiering core knows of, by id: the only owner of the records.

    ``max_pending_s`` bounds how long any request's lookups may stay pending.
    """

    def __init__(self, max_pending_s: float | None = None) -> None:
        self.max_pending_s = max_pending_s
        self._requests: dict[str, Request] = {}
        self._next_turn = 0

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests.values())

    def get(self, req_id: str) -> Request | None:
        return self._requests.get(req_id)

    def open(self, req_id: str) -> Request:
        """The request's record, made on first use."""
        request = self._requests.get(req_id)
        if request is None:
            request = self._requests[req_id] = Request(req_id)
        return request

    # ---------------------------------------------------------------- turns

    def turn_of(self, request: Request) -> int:
        """The request's turn in the promotion queues, given on first use."""
        turn = request.turn
        if turn is None:
            turn = request.turn = self._next_turn
            self._next_turn += 1
        return turn

    # ------------------------------------------------------------- deadline

    def allow(self, request: Request, key: OffloadKey, seconds: float | None) -> None:
        """The request waits for ``key``'s promotion, worth waiting ``seconds`` for
        (None: no bound of its own); counted once per key. The request's clock starts
        with its first allowance."""
        if seconds is None:
            return
        allowed = request.allowed
        if allowed is None:
            allowed = request.allowed = set()
            if request.since is None:
                request.since = time.perf_counter()
        elif key in allowed:
            return
        allowed.add(key)
        request.allowance_s += seconds

    def _limit(self, request: Request | None) -> float | None:
        limit = self.max_pending_s
        if request is None or request.allowed is None:
            return limit
        allowed = request.allowance_s
        return allowed if limit is None else min(limit, allowed)

    def expired(self, req_id: str) -> bool:
        """Whether the request's pending keys are misses now; the first call for a
        request with a limit starts its clock. Reads the clock only then: the lookup
        path calls this for every key that is not readable."""
        request = self._requests.get(req_id)
        if request is not None and request.expired:
            return True
        limit = self._limit(request)
        if limit is None:
            return False
        if request is None:
            request = self.open(req_id)
        now = time.perf_counter()
        if request.since is None:
            request.since = now
        if now - request.since <= limit:
            return False
        request.expired = True
        return True

    def remaining_s(self, req_id: str) -> float | None:
        """Seconds before the request's pending keys become misses: 0 once expired,
        None while it has no limit or its clock has not started."""
        request = self._requests.get(req_id)
        if request is None:
            return None
        if request.expired:
            return 0.0
        limit = self._limit(request)
        if limit is None or request.since is None:
            return None
        return max(0.0, limit - (time.perf_counter() - request.since))

    # ----------------------------------------------------------------- work

    def started(self, req_id: str) -> None:
        """A store or promotion of the request is in flight."""
        self.open(req_id).pending += 1

    def ended(self, req_id: str) -> bool:
        """A store or promotion ended; whether the request finished earlier and its
        tiers may hear of it now (its record is gone then)."""
        request = self._requests.get(req_id)
        if request is None or request.pending == 0:
            return False
        request.pending -= 1
        if request.finished and request.pending == 0:
            del self._requests[req_id]
            return True
        return False

    def live(self, req_id: str) -> bool:
        """Whether the request has work in flight and has not finished."""
        request = self._requests.get(req_id)
        return request is not None and not request.finished

    def scheduled(self, req_id: str) -> None:
        """The request was scheduled: its lookups count no more (what it counted goes)."""
        request = self._requests.get(req_id)
        if request is not None:
            request.counted = None

    def finish(self, req_id: str) -> bool:
        """The request finished: its waits and answers go; whether its tiers may hear
        of it now (else once its pending work ends)."""
        request = self._requests.get(req_id)
        if request is not None and request.pending > 0:
            request.finished = True
            request.forget_waits()
            request.answers = {}
            return False
        self._requests.pop(req_id, None)
        return True

    def reset(self) -> list[str]:
        """Forget every request (the primary tier is emptied) but what the unfinished
        ones counted, since they go on after the reset; the ids of those whose finish
        was waiting for their work, which their tiers may hear of now."""
        deferred = [req.req_id for req in self._requests.values() if req.finished]
        self._requests = {
            req_id: Request(req_id, counted=req.counted)
            for req_id, req in self._requests.items()
            if not req.finished
        }
        return deferred

    def clear_answers(self) -> None:
        """Forget every tier's kept answers (the primary tier was reset, or the tiers
        cleared)."""
        for request in self._requests.values():
            request.answers = {}
