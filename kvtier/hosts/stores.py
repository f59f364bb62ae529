"""Store when there is room: a host's keys into the primary tier, batch by batch.

Both the async facade and the page store copy bytes into primary slots the same way:
``prepare_store`` a batch, and if the primary tier has no room, wait while something
that holds slots may let go of them; copy into the slots; ``complete_store``, which
makes the chunks readable and starts their cascades. Only the copy differs (a GPU
worker's, awaited; a ``memmove`` from the caller's memory), and the host passes it in.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.hosts.fence import Fence
from kvtier.hosts.requests import Requests
from kvtier.hosts.waits import Step, step_until, step_until_blocking
from kvtier.keys import OffloadKey
from kvtier.records import PrepareStoreOutput, ReqContext
from kvtier.tiering.manager import TieringOffloadingManager

__all__ = ["StoreRoom", "Stored"]

#: Copies a batch's new keys (``out.keys_to_store``, whose positions in the call's keys
#: are in ``part``) into their slots (``out.store_spec.chunk_ids``); whether it did.
AsyncCopy = Callable[[PrepareStoreOutput, range], Awaitable[bool]]
#: The same for a thread: returns once copied, raises if it could not copy.
BlockingCopy = Callable[[PrepareStoreOutput, range], None]
#: Runs a copy to its end even if the task awaiting it is cancelled.
Shield = Callable[[Coroutine[Any, Any, int]], Awaitable[int]]


@dataclass
class Stored:
    """What one store call did."""

    #: Leading keys that found room: stored now, or stored already.
    keys: int = 0
    #: Keys newly copied into the primary tier.
    written: int = 0


class StoreRoom:
    """Store when there is room.

    Keys go in batches of at most half the primary tier, so that one batch never needs
    the whole tier (the other half may be pinned by loads in flight). A batch that
    finds no room waits while room may come: something completed since the refusal,
    tier work is in flight, a request's lease runs out, or the host says (``in_flight``)
    that calls of its own hold slots they will let go of. With none of these, or once
    the deadline passes (or the fence goes up), storing stops there.
    """

    def __init__(
        self,
        manager: TieringOffloadingManager,
        requests: Requests,
        *,
        in_flight: Callable[[], bool],
    ) -> None:
        self._manager = manager
        self._requests = requests
        self._in_flight = in_flight
        self.batch = max(1, manager.host.num_chunks // 2)

    def parts(self, count: int) -> list[range]:
        """The batches of a call storing ``count`` keys, as positions in its keys."""
        return [
            range(first, min(count, first + self.batch)) for first in range(0, count, self.batch)
        ]

    async def store(
        self,
        keys: Sequence[OffloadKey],
        req: ReqContext,
        copy: AsyncCopy,
        *,
        shield: Shield,
        deadline: float | None,
        fence: Fence,
    ) -> Stored:
        """Store ``keys`` for ``req`` (a task); each batch's copy and its
        ``complete_store`` run under ``shield``."""
        stored = Stored()
        for part in self.parts(len(keys)):
            room: list[PrepareStoreOutput] = []
            step = self._attempt([keys[i] for i in part], req, room)
            await step_until(
                self._manager.host,
                step,
                deadline=deadline,
                recheck=self._requests.next_lapse_s,
                fence=fence,
            )
            if not room:
                break
            stored.keys += len(part)
            if room[0].keys_to_store:
                stored.written += await shield(self._copy(room[0], part, req, copy))
        return stored

    def store_blocking(
        self,
        keys: Sequence[OffloadKey],
        req: ReqContext,
        copy: BlockingCopy,
        *,
        deadline: float,
    ) -> Stored:
        """:meth:`store` for a thread."""
        stored = Stored()
        for part in self.parts(len(keys)):
            room: list[PrepareStoreOutput] = []
            step = self._attempt([keys[i] for i in part], req, room)
            step_until_blocking(
                self._manager.host, step, deadline=deadline, recheck=self._requests.next_lapse_s
            )
            if not room:
                break
            stored.keys += len(part)
            out = room[0]
            if out.keys_to_store:
                success = False
                try:
                    copy(out, part)
                    success = True
                finally:
                    self._manager.complete_store(out.keys_to_store, req, success=success)
                stored.written += len(out.keys_to_store)
        return stored

    async def _copy(
        self, out: PrepareStoreOutput, part: range, req: ReqContext, copy: AsyncCopy
    ) -> int:
        success = False
        try:
            success = await copy(out, part)
        finally:
            self._manager.complete_store(out.keys_to_store, req, success=success)
        return len(out.keys_to_store) if success else 0

    def _attempt(
        self, keys: list[OffloadKey], req: ReqContext, room: list[PrepareStoreOutput]
    ) -> Callable[[], Step]:
        """The step of one batch: slots for ``keys`` go into ``room`` once there are."""
        manager = self._manager
        host = manager.host

        def step() -> Step:
            self._requests.expire()
            mark = host.completion_mark
            out = manager.prepare_store(keys, req)
            if out is not None:
                room.append(out)
                return Step.DONE
            # Room may come from work in flight, or be there already: a cascade that
            # ended after the refusal (the wait from the mark then ends at once).
            if (
                host.completed_since(mark)
                or manager.has_pending_work()
                or self._in_flight()
                or self._requests.keeping
            ):
                return Step.WAIT
            return Step.DONE

        return step
