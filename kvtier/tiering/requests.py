"""Work in flight per request, and finishes deferred until it ends.

Tiers hear that a request finished only once none of its stores or promotions is in
flight: a tier that forgets a request's state on "finished" must not see its work
afterwards. (The primary slots a request holds are the slot ledger's business.)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RequestTable"]


@dataclass(slots=True)
class _Request:
    pending: int = 0
    finished: bool = False


class RequestTable:
    """Work in flight per request; finishes deferred until the work ends."""

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

    def live(self, req_id: str) -> bool:
        """Whether the request has work in flight and has not finished."""
        request = self._requests.get(req_id)
        return request is not None and not request.finished

    def finish(self, req_id: str) -> bool:
        """Whether the request can be finished now (else once its work ends)."""
        request = self._requests.get(req_id)
        if request is not None and request.pending > 0:
            request.finished = True
            return False
        self._requests.pop(req_id, None)
        return True

    def reset(self) -> list[str]:
        """Forget every request (the primary tier is emptied); returns those whose
        finish was waiting for their work."""
        deferred = [req_id for req_id, request in self._requests.items() if request.finished]
        self._requests.clear()
        return deferred
