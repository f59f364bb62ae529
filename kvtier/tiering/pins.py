"""Pins that tiers hold on this node's primary slots (a p2p owner sending chunks).

A tier asks through :class:`~kvtier.tiers.base.PrimaryAccess`; the request travels
through the completion queue and is served here, under the manager's lock, since the
primary tier has one writer. A pin taken for a tier is a reader's reference on the
slot: the chunk stays readable and is not evicted until the tier releases it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvtier.keys import OffloadKey
from kvtier.primary import PrimaryTier
from kvtier.region import PrimaryView
from kvtier.tiering.outcomes import Outcome, PinRequest, UnpinRequest

__all__ = ["PinService"]


class PinService:
    """Serves pin and unpin requests of tiers against the primary tier."""

    def __init__(
        self, primary: PrimaryTier, view: PrimaryView, post: Callable[[Outcome], None]
    ) -> None:
        self._primary = primary
        self._view = view
        self._post = post
        #: Pins held for tiers, by key (a key may be pinned by several requests).
        self._held: dict[OffloadKey, int] = {}

    @property
    def held(self) -> bool:
        """Whether any tier holds a pin."""
        return bool(self._held)

    # PinBackend: called by tiers, on any thread; the work happens in serve_*.

    def request_pins(
        self,
        keys: tuple[OffloadKey, ...],
        future: asyncio.Future[dict[OffloadKey, memoryview]],
    ) -> None:
        self._post(PinRequest(keys, future))

    def release_pins(self, keys: tuple[OffloadKey, ...]) -> None:
        self._post(UnpinRequest(keys))

    # Served by the manager, under its lock.

    def serve_pin(self, request: PinRequest) -> None:
        pinned = self._primary.pin_readable(request.keys)
        held = self._held
        for key in pinned:
            held[key] = held.get(key, 0) + 1
        view = self._view
        rows = {key: view[slot] for key, slot in pinned.items()}
        future = request.future
        try:
            future.get_loop().call_soon_threadsafe(self._deliver, future, rows)
        except RuntimeError:  # that loop is closed: nobody is waiting for the rows
            self.serve_unpin(UnpinRequest(tuple(rows)))

    def _deliver(
        self,
        future: asyncio.Future[dict[OffloadKey, memoryview]],
        rows: dict[OffloadKey, memoryview],
    ) -> None:
        if future.done():  # the tier gave up waiting: release what it would have held
            self.release_pins(tuple(rows))
        else:
            future.set_result(rows)

    def serve_unpin(self, request: UnpinRequest) -> None:
        held = self._held
        released: list[OffloadKey] = []
        for key in request.keys:
            count = held.get(key, 0)
            if count == 0:
                continue  # a reset released it already
            if count == 1:
                del held[key]
            else:
                held[key] = count - 1
            released.append(key)
        if released:
            self._primary.complete_load(released)

    def forget(self) -> None:
        """The primary tier is being reset: every pin held for tiers goes with it."""
        self._held.clear()
