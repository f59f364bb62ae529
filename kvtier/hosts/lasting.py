"""Which chunks have a lasting copy: for a host that acknowledges only those.

A store into kvtier lands in the primary tier, which evicts what it must to make room;
the copy that outlives that eviction is the one a cascade writes into a secondary tier
that keeps copies of its own (:attr:`SecondaryTier.keeps_copies
<kvtier.tiers.SecondaryTier.keeps_copies>`). A host whose own memory lets a page go as
soon as kvtier acknowledges it (SGLang's ``buffer_only`` host memory) must hear "stored"
only once such a copy exists: :class:`LastingCopies` listens to the manager's cascades
(:meth:`~kvtier.tiering.host.HostAccess.listen_to_cascades`) and answers, for each key,
whether a lasting copy is known and whether one is still on its way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from kvtier.keys import OffloadKey

__all__ = ["LastingCopies"]


class LastingCopies:
    """The keys some lasting tier stored, and the cascades to such tiers in flight.

    ``tiers`` are the indices of the tiers that keep copies of their own; cascades to
    the others are not counted. The keys known to be stored are remembered up to
    ``remember`` of them, the least recently stored going first: a key forgotten that
    way is answered as having no known copy, which errs on the side of not
    acknowledging. Every call runs under the manager's lock.
    """

    def __init__(self, tiers: Collection[int], *, remember: int) -> None:
        if not tiers:
            raise ValueError("LastingCopies needs at least one tier that keeps copies")
        self.tiers = frozenset(tiers)
        self._remember = max(1, remember)
        self._stored: OrderedDict[OffloadKey, None] = OrderedDict()
        #: Cascades of each key to a lasting tier that have started and not ended.
        self._in_flight: dict[OffloadKey, int] = {}

    # The manager's calls (CascadeListener).

    def cascade_started(self, tier: int, keys: Sequence[OffloadKey]) -> None:
        if tier not in self.tiers:
            return
        in_flight = self._in_flight
        for key in keys:
            in_flight[key] = in_flight.get(key, 0) + 1

    def cascade_ended(self, tier: int, keys: Sequence[OffloadKey], stored: bool) -> None:
        if tier not in self.tiers:
            return
        in_flight = self._in_flight
        for key in keys:
            left = in_flight.get(key, 0) - 1
            if left > 0:
                in_flight[key] = left
            else:
                in_flight.pop(key, None)
        if stored:
            remembered = self._stored
            for key in keys:
                remembered[key] = None
                remembered.move_to_end(key)
            while len(remembered) > self._remember:
                remembered.popitem(last=False)

    # The host's questions.

    def has_copy(self, key: OffloadKey) -> bool:
        """Whether a lasting tier reported ``key`` stored (and it is still remembered)."""
        return key in self._stored

    def undecided(self, keys: Sequence[OffloadKey]) -> bool:
        """Whether some key without a known copy still has a cascade on its way."""
        stored, in_flight = self._stored, self._in_flight
        return any(key in in_flight and key not in stored for key in keys)
