"""Request lifetimes: one record per host request, from its first call to its one end.

The slots a request pins are the manager's record (its slot ledger); what a host keeps
of its own for a request lives here: whether it has ended, the chunks it claimed (it
computes them; other requests may wait for them instead of computing them too), and
the keys a lookup found that it keeps for a later call, on a lease. Every request
ends through :meth:`Requests.end`, which lets go of all of it and tells the manager.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.hosts.condition import Flag
from kvtier.keys import OffloadKey
from kvtier.records import ReqContext
from kvtier.tiering.manager import TieringOffloadingManager

__all__ = ["Claim", "Request", "Requests"]


@dataclass(eq=False)
class Claim:
    """A request computing a chunk that others may wait for instead of computing it."""

    owner: str
    #: Set once the owner stored the chunk, gave it up, or ended.
    done: Flag = field(default_factory=Flag)


@dataclass(eq=False)
class Request:
    """What a host keeps for one request (the slots it pins are the manager's record)."""

    req: ReqContext
    #: Ended (finished, lapsed, or swept away by a reset): it holds and takes nothing.
    ended: bool = False
    #: Keys the request said it computes, until it stores them or ends.
    claims: set[OffloadKey] = field(default_factory=set)
    #: Keys a lookup found and keeps for a later call (its promotions go on meanwhile).
    kept: set[OffloadKey] = field(default_factory=set)
    #: When the kept keys lapse (``time.monotonic()``) if no call takes them.
    expires: float = math.inf
    #: A call is using the request now: it does not lapse, and no other call takes it.
    busy: bool = False

    @property
    def req_id(self) -> str:
        return self.req.req_id


class Requests:
    """The requests of one host, by id; safe to call from any thread.

    A host names its requests (the facade takes its caller's ids) or has them named
    (:meth:`new`, for a host whose calls are requests of their own, as the page store's
    are). Ending a request (:meth:`end`) releases its claims, drops what it kept and
    calls the manager's ``on_request_finished``, which lets go of every slot it holds.
    """

    def __init__(
        self,
        manager: TieringOffloadingManager,
        *,
        prefix: str = "host",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._manager = manager
        self._prefix = prefix
        self._clock = clock
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._by_id: dict[str, Request] = {}
        self._claims: dict[OffloadKey, Claim] = {}
        #: Requests keeping keys for a later call, by each key they keep.
        self._kept: dict[OffloadKey, Request] = {}
        #: Requests that kept keys, in the order they kept them (ended ones leave lazily).
        self._leases: deque[Request] = deque()

    # -------------------------------------------------------------- lifetimes

    def of(self, req_id: str) -> Request:
        """The request named ``req_id``, opened by this call if it is not open."""
        with self._lock:
            request = self._by_id.get(req_id)
            if request is None:
                request = self._by_id[req_id] = Request(ReqContext(req_id))
            return request

    def get(self, req_id: str) -> Request | None:
        """The open request named ``req_id``, if any."""
        return self._by_id.get(req_id)

    def new(self) -> Request:
        """A new request with a name of its own (``<prefix>-<n>``)."""
        return self.of(f"{self._prefix}-{next(self._ids)}")

    def end(self, req_id: str) -> None:
        """The request is done: it ends, its claims are released, what it kept goes,
        and the manager lets go of its slots (also for a request never opened here)."""
        with self._lock:
            request = self._by_id.pop(req_id, None)
            if request is not None:
                self._close(request)
        self._manager.on_request_finished(ReqContext(req_id))

    def end_all(self) -> None:
        """End every open request (a reset or close, with no call in flight)."""
        with self._lock:
            ids = list(self._by_id)
        for req_id in ids:
            self.end(req_id)

    def _close(self, request: Request) -> None:
        request.ended = True
        self._release(request, list(request.claims))
        self._forget_kept(request)

    # ----------------------------------------------------------------- claims

    def claim(self, request: Request, keys: Iterable[OffloadKey]) -> int:
        """Claim the ``keys`` nobody claimed for ``request``; how many it newly claimed.
        An ended request claims nothing (nobody would release it)."""
        claimed = 0
        with self._lock:
            if request.ended:
                return 0
            for key in keys:
                if key not in self._claims:
                    self._claims[key] = Claim(request.req_id)
                    request.claims.add(key)
                    claimed += 1
        return claimed

    def claimant(self, key: OffloadKey) -> Claim | None:
        """The claim on ``key``, if a request computes it now."""
        return self._claims.get(key)

    def release_claims(self, request: Request, keys: Iterable[OffloadKey]) -> None:
        """The request stored ``keys`` (or gave them up): nobody waits for them."""
        with self._lock:
            self._release(request, keys)

    def _release(self, request: Request, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            if key in request.claims:
                request.claims.discard(key)
                claim = self._claims.pop(key, None)
                if claim is not None:
                    claim.done.set()

    # ----------------------------------------------------- keys kept on lease

    def keep(self, request: Request, keys: Sequence[OffloadKey], lease_s: float) -> None:
        """The request keeps ``keys`` for a later call, at most ``lease_s`` seconds."""
        with self._lock:
            request.kept.update(keys)
            request.expires = self._clock() + lease_s
            for key in keys:
                self._kept[key] = request
            self._leases.append(request)

    def resume(self, first: OffloadKey) -> Request | None:
        """The request that kept ``first``, now busy with the calling call; None if
        none keeps it or another call is using it."""
        with self._lock:
            request = self._kept.get(first)
            if request is None or request.busy or not request.kept:
                return None
            request.busy = True
            return request

    def done_with(self, request: Request, keys: Iterable[OffloadKey]) -> None:
        """A call that used ``request`` ended having taken ``keys``: they leave what it
        keeps, and the request ends once it keeps nothing (or kept nothing)."""
        with self._lock:
            request.busy = False
            for key in keys:
                request.kept.discard(key)
                if self._kept.get(key) is request:
                    del self._kept[key]
            if request.kept:
                return
        self.end(request.req_id)

    def expire(self) -> None:
        """End the requests whose lease ran out with no call taking their keys."""
        now = self._clock()
        lapsed: list[Request] = []
        with self._lock:
            # Every lease, not only the oldest: leases differ in length, so a later one
            # may run out first, and next_lapse_s (which a store's wait wakes by) counts
            # it. A request a call is using now is ended by that call.
            live: deque[Request] = deque()
            for request in self._leases:
                if not request.kept:
                    continue
                if request.expires <= now and not request.busy:
                    lapsed.append(request)
                    self._forget_kept(request)
                else:
                    live.append(request)
            self._leases = live
        for request in lapsed:
            self.end(request.req_id)

    def next_lapse_s(self) -> float | None:
        """Seconds until the first lease runs out (None: no request keeps keys)."""
        with self._lock:
            live = [r.expires for r in self._leases if r.kept and not r.busy]
        return None if not live else max(0.0, min(live) - self._clock())

    @property
    def keeping(self) -> bool:
        """Whether some request keeps keys (and the slots promoted for them)."""
        return bool(self._kept)

    def _forget_kept(self, request: Request) -> None:
        for key in request.kept:
            if self._kept.get(key) is request:
                del self._kept[key]
        request.kept.clear()
