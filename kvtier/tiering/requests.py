"""Requests with stores in flight.

Tiers hear that a request finished only once none of its stores is pending: a tier
that forgets a request's state on "finished" must not see a store of it afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestTable"]


@dataclass(slots=True)
class _Request:
    pending_stores: int = 0
    finished: bool = False


class RequestTable:
    """Pending stores per request, and the finishes deferred until they end."""

    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}

    def store_started(self, req_id: str) -> None:
        request = self._requests.get(req_id)
        if request is None:
            request = self._requests[req_id] = _Request()
        request.pending_stores += 1

    def store_ended(self, req_id: str) -> bool:
        """Whether the request finished earlier and now has no store pending."""
        request = self._requests.get(req_id)
        if request is None or request.pending_stores == 0:
            return False
        request.pending_stores -= 1
        if request.finished and request.pending_stores == 0:
            del self._requests[req_id]
            return True
        return False

    def finish(self, req_id: str) -> bool:
        """Whether the request can be finished now (else once its stores end)."""
        request = self._requests.get(req_id)
        if request is not None and request.pending_stores > 0:
            request.finished = True
            return False
        self._requests.pop(req_id, None)
        return True

    def reset(self) -> list[str]:
        """Forget every request; returns those whose finish was waiting for stores."""
        deferred = [req_id for req_id, request in self._requests.items() if request.finished]
        self._requests.clear()
        return deferred
