"""The ``store_threshold`` gate: store a chunk only once it was looked up enough times."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvtier.keys import OffloadKey

__all__ = ["LookupCounter"]


class LookupCounter:
    """Counts lookups per key, in bounded memory.

    Only the ``max_tracked`` most recently looked-up keys are remembered: a key that
    falls out starts counting again, which errs on the side of not storing.
    """

    def __init__(self, threshold: int, max_tracked: int) -> None:
        self.threshold = threshold
        self.max_tracked = max_tracked
        self._counts: OrderedDict[OffloadKey, int] = OrderedDict()

    def count(self, key: OffloadKey) -> None:
        counts = self._counts
        if key in counts:
            counts.move_to_end(key)
            counts[key] += 1
        else:
            if len(counts) >= self.max_tracked:
                counts.popitem(last=False)
            counts[key] = 1

    def admitted(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        counts, threshold = self._counts, self.threshold
        return [key for key in keys if counts.get(key, 0) >= threshold]
