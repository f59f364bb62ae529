"""Pins that tiers hold on this node's primary slots (a p2p owner sending chunks).

A tier asks through :class:`~kvtier.tiers.base.PrimaryAccess`; the request travels
through the completion queue and is served here, under the manager's lock, since the
primary tier has one writer. A pin taken for a tier is held in the slot ledger under
the tier's name: the chunk stays readable and is not evicted until the tier releases it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvtier.keys import OffloadKey
from kvtier.region import PrimaryView
from kvtier.tiering.ledger import Holder, SlotLedger
from kvtier.tiering.outcomes import Outcome, PinRequest, UnpinRequest

__all__ = ["PinService", "TierPins"]


class TierPins:
    """One tier's side of the pin service: what its :class:`PrimaryAccess` is bound to.

    Called by the tier, on any thread; the work happens in :class:`PinService`.
    """

    def __init__(self, holder: Holder, post: Callable[[Outcome], None]) -> None:
        self._holder = holder
        self._post = post

    def request_pins(
        self,
        keys: tuple[OffloadKey, ...],
        future: asyncio.Future[dict[OffloadKey, memoryview]],
    ) -> None:
        self._post(PinRequest(self._holder, keys, future))

    def release_pins(self, keys: tuple[OffloadKey, ...]) -> None:
        self._post(UnpinRequest(self._holder, keys))


class PinService:
    """Serves pin and unpin requests of tiers against the slot ledger."""

    def __init__(
        self, ledger: SlotLedger, view: PrimaryView, post: Callable[[Outcome], None]
    ) -> None:
        self._ledger = ledger
        self._view = view
        self._post = post

    def for_tier(self, label: str) -> TierPins:
        return TierPins(Holder.tier(label), self._post)

    def serve_pin(self, request: PinRequest) -> None:
        pinned = self._ledger.pin_readable(request.keys, request.holder)
        view = self._view
        rows = {key: view[slot] for key, slot in pinned.items()}
        future = request.future
        try:
            future.get_loop().call_soon_threadsafe(self._deliver, request, rows)
        except RuntimeError:  # that loop is closed: nobody is waiting for the rows
            self._ledger.release_held(list(rows), request.holder)

    def _deliver(self, request: PinRequest, rows: dict[OffloadKey, memoryview]) -> None:
        future = request.future
        if future.done():  # the tier gave up waiting: release what it would have held
            self._post(UnpinRequest(request.holder, tuple(rows)))
        else:
            future.set_result(rows)

    def serve_unpin(self, request: UnpinRequest) -> None:
        # A reset released them already if the ledger no longer has them.
        self._ledger.release_held(request.keys, request.holder)
