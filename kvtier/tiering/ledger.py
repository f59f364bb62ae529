"""Who holds each primary slot, and when a slot may be used again.

The primary tier maps keys to slots and counts readers per slot; this ledger names
every holder behind those counts, so that no slot goes back to the free list while
anything may still touch it:

- a **request** pins the readable keys its lookups found until it loads them or ends;
- a key promoted for a request is **reserved** for it until the request takes it over
  (:meth:`SlotLedger.transfer`, one move, no second pin) or ends;
- a **job** (a cascade) pins the keys whose slots its tier reads;
- a **tier** pins the keys whose slots it serves to others (p2p);
- **io**: the I/O of a job given up at its timeout may still run; its slots stay out of
  use until its coroutine has returned *and* no row of the slot handed out through
  :class:`~kvtier.region.PrimaryView` is referenced any more, which covers threads a
  plugin tier started and did not wait for;
- **host** copies that were in flight at a reset the host flushes later.

A slot that no key names any more but a holder still keeps is *quarantined*: counted,
never handed out. Everything here runs under the manager's lock.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvtier.errors import StateError
from kvtier.keys import OffloadKey, format_key
from kvtier.primary import PrimaryTier
from kvtier.region import PrimaryView

__all__ = ["HOST_COPIES", "Holder", "HolderKind", "SlotLedger"]


class HolderKind(str, enum.Enum):
    """The kinds of holder of primary slots (the module's docstring says each one's
    part). A ``str`` enum: a :class:`Holder` of it still hashes in C."""

    REQUEST = "request"
    RESERVED = "reserved"
    JOB = "job"
    TIER = "tier"
    IO = "io"
    HOST = "host"

    def __str__(self) -> str:
        return self.value


class Holder(NamedTuple):
    """One holder of primary slots: its kind and its name within the kind.

    A tuple of two values that hash in C, for the scheduler's hot paths.
    """

    kind: HolderKind
    name: str | int

    @classmethod
    def request(cls, req_id: str) -> Holder:
        return cls(HolderKind.REQUEST, req_id)

    @classmethod
    def reserved(cls, req_id: str) -> Holder:
        return cls(HolderKind.RESERVED, req_id)

    @classmethod
    def job(cls, job_id: int) -> Holder:
        return cls(HolderKind.JOB, job_id)

    @classmethod
    def tier(cls, label: str) -> Holder:
        return cls(HolderKind.TIER, label)

    @classmethod
    def io(cls, job_id: int) -> Holder:
        return cls(HolderKind.IO, job_id)

    def __str__(self) -> str:
        return f"{self.kind} {self.name!r}"


#: The host's copies in flight at a reset it flushes later (vLLM's).
HOST_COPIES = Holder(HolderKind.HOST, "copies")


class SlotLedger:
    """Every holder of a primary slot, by name; the only caller of the primary tier's
    pin and release operations."""

    def __init__(self, primary: PrimaryTier, view: PrimaryView | None) -> None:
        self._primary = primary
        self._view = view
        #: Pins on readable keys, per holder, with how many each.
        self._pins: dict[Holder, dict[OffloadKey, int]] = {}
        #: Slots no key names any more, kept out of use by their holders.
        self._kept: dict[Holder, set[int]] = {}

    # ------------------------------------------------------------------ pins

    def pin(self, keys: Sequence[OffloadKey], holder: Holder) -> list[int]:
        """Pin readable ``keys`` for ``holder``; their slots.

        Raises:
            StateError: a key is not readable (nothing is pinned).
        """
        slots = list(self._primary.prepare_load(keys).chunk_ids)
        self._add(holder, keys)
        return slots

    def pin_for_request(self, keys: Sequence[OffloadKey], req_id: str) -> list[int]:
        """Pin readable ``keys`` for a request; keys promoted for it (reserved) are
        transferred to it, not pinned a second time. Their slots. The load is a use
        of the request's prefix for the eviction policy.

        Raises:
            StateError: a key is not readable (nothing is pinned).
        """
        holder = Holder.request(req_id)
        taken = self.transfer(keys, Holder.reserved(req_id), holder)
        if not taken:
            slots = self.pin(keys, holder)
            self._primary.touch(keys, req_id)
            return slots
        rest = list(keys)
        for key in taken:
            rest.remove(key)
        try:
            self.pin(rest, holder)
        except StateError:
            self.transfer(taken, holder, Holder.reserved(req_id))
            raise
        self._primary.touch(keys, req_id)
        slot_of = self._primary.slot_of
        return [slot for key in keys if (slot := slot_of(key)) is not None]

    def pin_readable(self, keys: Iterable[OffloadKey], holder: Holder) -> dict[OffloadKey, int]:
        """Pin each of ``keys`` that is readable now, once each; their slots."""
        pinned = self._primary.pin_readable(keys)
        self._add(holder, pinned)
        return pinned

    def release(self, keys: Sequence[OffloadKey], holder: Holder) -> None:
        """Release one pin of ``holder`` on each of ``keys``.

        Raises:
            StateError: ``holder`` holds no pin on one of the keys (nothing is released).
        """
        if not keys:
            return
        held = self._pins.get(holder, {})
        # One pass that checks and takes (the scheduler's hot path), undone on a miss.
        for done, key in enumerate(keys):
            count = held.get(key, 0)
            if count == 0:
                for taken in keys[:done]:
                    held[taken] = held.get(taken, 0) + 1
                raise StateError(f"{holder} holds no pin on key {format_key(key)} to release")
            if count == 1:
                del held[key]
            else:
                held[key] = count - 1
        if not held:
            self._pins.pop(holder, None)
        self._primary.complete_load(keys)

    def release_held(self, keys: Iterable[OffloadKey], holder: Holder) -> list[OffloadKey]:
        """Release one pin of ``holder`` on each of ``keys`` it holds (others are
        skipped); the keys released."""
        held = self._pins.get(holder)
        if not held:
            return []
        released = [key for key in keys if held.get(key, 0) > 0 and self._take_one(held, key)]
        if not held:
            del self._pins[holder]
        if released:
            self._primary.complete_load(released)
        return released

    def release_request(self, req_id: str) -> None:
        """Release every pin a request holds, read or reserved for it."""
        self.release_all(Holder.reserved(req_id))
        self.release_all(Holder.request(req_id))

    def release_all(self, holder: Holder) -> list[OffloadKey]:
        """Release every pin of ``holder``; the keys (one entry per pin)."""
        held = self._pins.pop(holder, None)
        if not held:
            return []
        keys = [key for key, count in held.items() for _ in range(count)]
        self._primary.complete_load(keys)
        return keys

    def transfer(
        self, keys: Iterable[OffloadKey], source: Holder, target: Holder
    ) -> list[OffloadKey]:
        """Hand ``source``'s pins on ``keys`` to ``target`` (one each; keys ``source``
        does not hold are skipped); the keys handed over. The slots never change hands
        in the primary tier: no pin is taken or released."""
        held = self._pins.get(source)
        if not held:
            return []
        moved = [key for key in keys if held.get(key, 0) > 0 and self._take_one(held, key)]
        if not held:
            del self._pins[source]
        self._add(target, moved)
        return moved

    def transfer_all(self, source: Holder, target: Holder) -> None:
        """Hand every pin of ``source`` to ``target``."""
        held = self._pins.pop(source, None)
        if held:
            self._add_counts(target, held)

    def held(self, holder: Holder) -> dict[OffloadKey, int]:
        """The keys ``holder`` pins, with their slots (read, never change)."""
        held = self._pins.get(holder)
        if not held:
            return {}
        slot_of = self._primary.slot_of
        return {key: slot for key in held if (slot := slot_of(key)) is not None}

    def holds(self, holder: Holder, key: OffloadKey) -> bool:
        held = self._pins.get(holder)
        return held is not None and key in held

    def any_pins(self, kind: HolderKind) -> bool:
        """Whether a holder of ``kind`` pins anything."""
        return any(holder.kind == kind for holder in self._pins)

    # ------------------------------------------------------------ quarantine

    def keep(self, slots: Iterable[int], holder: Holder) -> None:
        """``holder`` keeps ``slots``, which no key names any more, out of use."""
        slots = set(slots)
        if slots:
            self._kept.setdefault(holder, set()).update(slots)

    @property
    def quarantined(self) -> int:
        """Slots out of use for late I/O or host copies: kept with no key, or pinned
        (still readable) by late I/O that may be reading them."""
        slots = self.kept_slots()
        slot_of = self._primary.slot_of
        for holder, held in self._pins.items():
            if holder.kind is HolderKind.IO:
                slots.update(slot for key in held if (slot := slot_of(key)) is not None)
        return len(slots)

    def kept_slots(self) -> set[int]:
        """Slots no key names that a holder keeps out of use."""
        kept: set[int] = set()
        for slots in self._kept.values():
            kept |= slots
        return kept

    def io_gave_up(self, job_id: int, written: Sequence[OffloadKey]) -> None:
        """A job timed out while its I/O may still run: hand its slots to ``io``.

        A promotion's slots (``written``, still being written) stop naming their keys
        at once, so the keys are misses; a cascade's pins go from the job to ``io``.
        """
        io = Holder.io(job_id)
        self.keep(self._primary.detach(written), io)
        self.transfer_all(Holder.job(job_id), io)

    def io_ended(self, job_id: int) -> bool:
        """The coroutine of a job that timed out has returned (a late completion).

        Its slots go back as soon as no row of them is referenced; whether some are
        still in use (call :meth:`settle` again later).
        """
        return self.settle(Holder.io(job_id))

    def settle(self, holder: Holder | None = None) -> bool:
        """Let ``io`` holders (or just ``holder``) go of what no thread touches any
        more; whether any ``io`` holder still keeps something."""
        holders = [holder] if holder is not None else [*self._kept, *self._pins]
        for each in holders:
            if each.kind is HolderKind.IO:
                self._settle_io(each)
        return any(h.kind is HolderKind.IO for h in (*self._kept, *self._pins))

    def _settle_io(self, holder: Holder) -> None:
        in_use = self._in_use
        kept = self._kept.get(holder)
        if kept:
            done = {slot for slot in kept if not in_use(slot)}
            kept -= done
            if not kept:
                del self._kept[holder]
            # A slot host copies also keep (a reset came meanwhile) waits for them too.
            self._primary.free_slots(sorted(done - self.kept_slots(), reverse=True))
        held = self._pins.get(holder)
        if held:
            slot_of = self._primary.slot_of
            released: list[OffloadKey] = []
            for key in [key for key in held if not in_use(slot_of(key))]:
                released += [key] * held.pop(key)
            if not held:
                del self._pins[holder]
            self._primary.complete_load(released)

    def _in_use(self, slot: int | None) -> bool:
        return slot is not None and self._view is not None and self._view.in_use(slot)

    def release_host_copies(self) -> None:
        """The host's copies in flight at the last reset have ended."""
        slots = self._kept.pop(HOST_COPIES, set())
        still_kept = self.kept_slots()
        self._primary.free_slots(sorted(slots - still_kept, reverse=True))

    # ----------------------------------------------------------------- reset

    def reset(self, *, hold_host_copies: bool = False) -> None:
        """Empty the primary tier in one operation.

        Every pin goes with its key, except those of late I/O, whose slots stay kept;
        with ``hold_host_copies`` the slots that host copies were writing or reading
        (being written, or pinned by a request) stay kept until
        :meth:`release_host_copies`.
        """
        primary = self._primary
        for holder in [h for h in self._pins if h.kind is HolderKind.IO]:
            held = self._pins.pop(holder)
            self.keep((s for key in held if (s := primary.slot_of(key)) is not None), holder)
        if hold_host_copies:
            self.keep(primary.busy_slots(), HOST_COPIES)
        self._pins.clear()
        primary.reset(keep=self.kept_slots())

    # --------------------------------------------------------------- helpers

    def _add(self, holder: Holder, keys: Iterable[OffloadKey]) -> None:
        held = self._pins.get(holder)
        if held is None:
            held = self._pins[holder] = {}
        for key in keys:
            held[key] = held.get(key, 0) + 1
        if not held:
            del self._pins[holder]

    def _add_counts(self, holder: Holder, counts: dict[OffloadKey, int]) -> None:
        held = self._pins.setdefault(holder, {})
        for key, count in counts.items():
            held[key] = held.get(key, 0) + count

    @staticmethod
    def _take_one(held: dict[OffloadKey, int], key: OffloadKey) -> bool:
        count = held[key]
        if count == 1:
            del held[key]
        else:
            held[key] = count - 1
        return True
