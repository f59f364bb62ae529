"""What becomes of a stored chunk that fails verification (:mod:`kvtier.format`).

Such a chunk is never served: the tier counts it as an integrity failure, removes it so
that it is stored again whole, and says so in one log line per operation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence

from kvtier._logs import ThrottledLog
from kvtier.keys import OffloadKey
from kvtier.tiers.base import TierContext

__all__ = ["CorruptChunks"]


class CorruptChunks:
    """A tier's handling of stored chunks that failed verification.

    ``where`` gives a chunk's location (a path, a URL) for the log line.
    """

    def __init__(
        self, ctx: TierContext, log: ThrottledLog, where: Callable[[OffloadKey], object]
    ) -> None:
        self._ctx = ctx
        self._log = log
        self._where = where

    async def discard(
        self,
        problems: Mapping[OffloadKey, str],
        during: str,
        remove: Callable[[Sequence[OffloadKey]], Awaitable[Sequence[OffloadKey]]],
    ) -> Sequence[OffloadKey]:
        """Count, remove and report chunks found corrupt ``during`` one operation.

        ``problems`` maps each key to what was wrong with its chunk. ``remove``
        deletes chunks by key and returns the keys it removed; it must not raise (a
        chunk it could not remove fails verification again next time). Returns the
        keys whose chunks were removed.
        """
        if not problems:
            return []
        self._ctx.report_integrity_failure(len(problems))
        removed = await remove(list(problems))
        self._log.warning(
            "corrupt",
            "%d stored chunk(s) failed verification during %s (%s), e.g. %s; "
            "%d removed, never served",
            len(problems),
            during,
            ", ".join(sorted(set(problems.values()))),
            self._where(next(iter(problems))),
            len(removed),
        )
        return removed
