"""What a host needs of the manager beyond the scheduler protocol.

The :class:`~kvtier.KVTier` facade and hosts like it look a whole prefix up at once,
wait for tier work without polling, and know how big the primary tier is; any host may
say what recomputing a chunk costs it and stop waiting for a request's chunks. Every
call here runs under the manager's lock, as the scheduler protocol's do, and the slots
a request holds are the slot ledger's record, so a host keeps no ledger of its own.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvtier.keys import OffloadKey
from kvtier.records import LookupResult, ReqContext
from kvtier.tiering.core import TieringCore
from kvtier.tiering.jobs import CascadeListener
from kvtier.tiering.ledger import Holder

__all__ = ["HostAccess", "PrefixLookup"]

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """What one :meth:`HostAccess.lookup_prefix` call found."""

    #: Keys readable now, pinned for the request, with their slots.
    pinned: dict[OffloadKey, int]
    #: Whether some key before the first miss is still on its way (written, promoted,
    #: or asked of a tier): worth waiting for.
    pending: bool
    #: :attr:`HostAccess.completion_mark` as the lookup began: wait with it, and what
    #: completes between this answer and the wait is not missed.
    mark: int


class HostAccess:
    """The manager's face for a host: prefixes, pins held, waiting, deadlines, costs.

    It calls down to the tiering core (:mod:`~kvtier.tiering.core`), as the scheduler
    protocol does.
    """

    def __init__(self, core: TieringCore) -> None:
        self._core = core
        self._lock = core.lock
        self._ledger = core.ledger
        self._primary = core.primary
        self._completions = core.completions

    @property
    def recompute_s_per_chunk(self) -> float | None:
        """The recompute cost promotions are weighed against (None: always promote)."""
        return self._core.costs.recompute_s_per_chunk

    def set_recompute_cost(self, seconds_per_chunk: float | None) -> None:
        """What recomputing one chunk costs the host (prefill seconds, updated as it
        measures): a secondary hit whose promotion would take longer is a miss, counted
        in ``kvtier_tiering_skipped_slower_than_recompute``. None: always promote.

        Raises:
            ValueError: ``seconds_per_chunk`` is not a positive number or None.
        """
        if seconds_per_chunk is not None and not seconds_per_chunk > 0:
            raise ValueError(f"seconds_per_chunk must be > 0 or None, got {seconds_per_chunk!r}")
        with self._lock:
            self._core.costs.recompute_s_per_chunk = seconds_per_chunk

    def expire_pending(self, req: ReqContext) -> None:
        """Stop waiting for the request's pending chunks: they are misses for it from
        now on, its promotions not started yet free their slots, and those that finish
        later are not kept for it."""
        with self._lock:
            self._core.expire(req.req_id)

    def pending_remaining_s(self, req: ReqContext) -> float | None:
        """Seconds before the request's pending chunks become misses (its deadline:
        ``max_pending_s``, or what its promotions are worth waiting for once the
        recompute cost is known); None while nothing bounds its wait."""
        with self._lock:
            return self._core.requests.remaining_s(req.req_id)

    def load_source(self, key: OffloadKey, req: ReqContext) -> str | None:
        """The label of the secondary tier that promoted ``key`` for the request; None if
        the request found it in the primary tier (or has finished since)."""
        with self._lock:
            request = self._core.requests.get(req.req_id)
            tier = None if request is None else request.sources.get(key)
            return None if tier is None else self._core.tiers[tier].label

    def listen_to_cascades(self, listener: CascadeListener) -> None:
        """Tell ``listener`` of every cascade from now on: when it starts and how it
        ends (for a host whose acknowledgement of a store means that a tier holds a copy
        of the chunk)."""
        with self._lock:
            self._core.jobs.cascade_listeners.append(listener)

    @property
    def num_chunks(self) -> int:
        """Slots of the primary tier."""
        return self._primary.num_chunks

    def lookup_prefix(self, keys: Sequence[OffloadKey], req: ReqContext) -> PrefixLookup:
        """Look a whole prefix up in one call, pinning what is readable for the request.

        Walks ``keys`` in order, skipping those the request pins already, up to the
        first key no tier holds. Keys readable now are pinned for the request (each
        released by :meth:`~TieringOffloadingManager.complete_load`, or all at once
        when the request finishes); keys on their way (being written, promoted or
        asked) make the answer pending. Promotions started here never evict a key of
        ``keys``.
        """
        core = self._core
        with self._lock:
            mark = self._completions.seq
            core.poll()
            req_id = req.req_id
            holder = Holder.request(req_id)
            held = self._ledger.holds
            lookup = core.lookup
            prefix = set(keys) if core.tiers else None
            readable: list[OffloadKey] = []
            pending = False
            for key in keys:
                if held(holder, key):
                    continue
                result = lookup(key, req_id, prefix, req.load_tiers)
                if result is _HIT:
                    readable.append(key)
                elif result is _MISS:
                    break
                else:
                    pending = True
            slots = self._ledger.pin_for_request(readable, req_id) if readable else []
            return PrefixLookup(dict(zip(readable, slots, strict=True)), pending, mark)

    def held(self, req: ReqContext) -> dict[OffloadKey, int]:
        """The keys the request pins, with their slots."""
        with self._lock:
            return self._ledger.held(Holder.request(req.req_id))

    def release_except(self, req: ReqContext, keep: Collection[OffloadKey]) -> None:
        """Release the request's pins on every key not in ``keep``."""
        with self._lock:
            holder = Holder.request(req.req_id)
            stray = [key for key in self._ledger.held(holder) if key not in keep]
            while stray:
                stray = self._ledger.release_held(stray, holder)
            self._completions.notify()

    def readable_prefix(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading ``keys`` are readable in the primary tier right now."""
        with self._lock:
            self._core.poll()
            return self._primary.readable_prefix(keys)

    @property
    def completion_mark(self) -> int:
        """How many completions so far. A host reads it before it checks what it waits
        for and passes it to :meth:`wait_for_completions` as ``since``: a completion
        between the check and the wait then ends the wait at once."""
        return self._completions.seq

    def completed_since(self, mark: int) -> bool:
        """Whether anything completed after the :attr:`completion_mark` ``mark``."""
        return self._completions.seq != mark

    async def wait_for_completions(self, since: int | None = None) -> None:
        """Resolve once a job, lookup or store finished after ``since`` (a
        :attr:`completion_mark`; None: after this call), or at once if an outcome
        waits to be applied."""
        await self._completions.wait_for_any(since)

    def wait_for_completions_blocking(
        self, timeout: float | None = None, since: int | None = None
    ) -> None:
        """:meth:`wait_for_completions` for a synchronous host's thread."""
        self._completions.wait_for_any_blocking(timeout, since)

    async def drain(self) -> None:
        """Send what the step queued and resolve once nothing is in flight, jobs that
        timed out and still run included."""
        await self.settle(include_tier_pins=False, include_late=True)

    async def settle(self, *, include_tier_pins: bool, include_late: bool) -> None:
        """Resolve once no job or lookup is in flight; with ``include_tier_pins`` once
        no tier pins a slot either, with ``include_late`` once no job that timed out
        still runs."""
        await self._core.settle(include_tier_pins=include_tier_pins, include_late=include_late)
