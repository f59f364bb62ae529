"""Where a tier's I/O that a contract test holds up is: reached, held, finished."""

from __future__ import annotations

import threading

__all__ = ["Stall"]


class Stall:
    """Where a tier's held I/O is: reached, still held, finished.

    A stall hook (:meth:`~kvtier.testing.TierContract.stall_loads`,
    :meth:`~kvtier.testing.TierContract.stall_stores`) yields one. The I/O it holds (a
    thread blocked in a syscall, a request whose answer a proxy keeps back) reports
    through :meth:`reach`, :meth:`give_up` and :meth:`finish`, from any thread; or a
    subclass computes :meth:`reached`, :meth:`holding` and :meth:`finished` itself (by
    polling the kernel, say).
    """

    def __init__(self) -> None:
        self._reached = threading.Event()
        self._gave_up = threading.Event()
        self._finished = threading.Event()

    def reach(self) -> None:
        """The held I/O got to the stall and waits there."""
        self._reached.set()

    def give_up(self) -> None:
        """The held I/O stopped waiting (its client went away): it touches nothing more."""
        self._gave_up.set()

    def finish(self) -> None:
        """The held I/O has ended: it touches no slot any more."""
        self._finished.set()

    def reached(self) -> bool:
        """Whether the held I/O ever got to the stall (stays true once it did)."""
        return self._reached.is_set()

    def holding(self) -> bool:
        """Whether the I/O is held there right now: it may still touch its slot."""
        return self.reached() and not (self._gave_up.is_set() or self._finished.is_set())

    def finished(self) -> bool:
        """Whether the held I/O is over, completed or abandoned (asked after release)."""
        return self._gave_up.is_set() or self._finished.is_set()
