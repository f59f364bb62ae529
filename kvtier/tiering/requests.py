"""What the manager holds per request: work in flight, and promoted chunks kept for it.

Tiers hear that a request finished only once none of its stores or promotions is in
flight: a tier that forgets a request's state on "finished" must not see its work
afterwards. A chunk promoted for a request stays pinned for it (reserved) until the
request loads it or finishes, so other requests cannot evict it in between.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.keys import OffloadKey

__all__ = ["RequestTable"]


@dataclass(slots=True)
class _Request:
    pending: int = 0
    finished: bool = False
    #: Promoted keys pinned for the request, with how many pins each.
    reserved: dict[OffloadKey, int] = field(default_factory=dict)


class RequestTable:
    """Work in flight and reservations per request; finishes deferred until work ends."""

    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}

    def started(self, req_id: str) -> None:
        """A store or promotion of the request is in flight."""
        request = self._requests.get(req_id)
        if request is None:
            request = self._requests[req_id] = _Request()
        request.pending += 1

    def ended(self, req_id: str) -> bool:
        """A store or promotion ended; whether the request finished earlier and can go now."""
        request = self._requests.get(req_id)
        if request is None or request.pending == 0:
            return False
        request.pending -= 1
        if request.finished and request.pending == 0:
            del self._requests[req_id]
            return True
        return False

    def finish(self, req_id: str) -> bool:
        """Whether the request can be finished now (else once its work ends)."""
        request = self._requests.get(req_id)
        if request is not None and request.pending > 0:
            request.finished = True
            return False
        self._requests.pop(req_id, None)
        return True

    def reserve(self, req_id: str, keys: Iterable[OffloadKey]) -> bool:
        """Record pins taken for a live request; False (record nothing) if it finished."""
        request = self._requests.get(req_id)
        if request is None or request.finished:
            return False
        reserved = request.reserved
        for key in keys:
            reserved[key] = reserved.get(key, 0) + 1
        return True

    def claim(self, req_id: str, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The request pins ``keys`` itself now: the reservations among them, removed."""
        request = self._requests.get(req_id)
        if request is None or not request.reserved:
            return []
        reserved = request.reserved
        claimed: list[OffloadKey] = []
        for key in keys:
            count = reserved.get(key, 0)
            if count:
                claimed.append(key)
                if count == 1:
                    del reserved[key]
                else:
                    reserved[key] = count - 1
        return claimed

    def take_reserved(self, req_id: str) -> list[OffloadKey]:
        """Every reservation of the request, removed (one entry per pin)."""
        request = self._requests.get(req_id)
        if request is None or not request.reserved:
            return []
        reserved, request.reserved = request.reserved, {}
        return [key for key, count in reserved.items() for _ in range(count)]

    def reset(self) -> list[str]:
        """Forget every request (the primary tier is emptied, reservations with it);
        returns those whose finish was waiting for their work."""
        deferred = [req_id for req_id, request in self._requests.items() if request.finished]
        self._requests.clear()
        return deferred
