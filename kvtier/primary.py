"""The primary tier's bookkeeping: which key lives in which slot, and who holds it."""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Sequence

from kvtier.errors import StateError
from kvtier.keys import OffloadKey, format_key
from kvtier.policies.base import CachePolicy
from kvtier.records import (
    EventLog,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    PrepareStoreOutput,
)

__all__ = ["PRIMARY_LABEL", "PrimaryTier", "SlotRecord"]

#: The tier label of the primary tier in metrics and events.
PRIMARY_LABEL = "0:primary"

_EMPTY_SPEC = LoadStoreSpec(chunk_ids=())


class SlotRecord:
    """One stored key: its slot in the region and its reference count.

    ``ref_cnt`` is -1 while the slot is being written, 0 when it is readable and
    evictable, and n > 0 while n readers hold it.
    """

    __slots__ = ("ref_cnt", "slot")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.ref_cnt = -1

    def __repr__(self) -> str:
        return f"SlotRecord(slot={self.slot}, ref_cnt={self.ref_cnt})"


class PrimaryTier:
    """Slots of the primary region, their ref counts, a free list and a policy.

    The GPU-facing calls are ``prepare_load``/``complete_load`` (GPU reads a slot) and
    ``prepare_store``/``complete_store`` (GPU writes a slot). A secondary tier uses the
    same operations under names that say what they mean from its side:
    ``prepare_read``/``complete_read`` pin a slot a cascade reads, and
    ``prepare_write``/``complete_write`` fill a slot a promotion writes.

    Not thread-safe: the manager is its only caller.
    """

    medium = Medium.CPU
    label = PRIMARY_LABEL

    def __init__(
        self, num_chunks: int, policy: CachePolicy, *, enable_events: bool = False
    ) -> None:
        if num_chunks < 1:
            raise ValueError(f"the primary tier needs at least one chunk, got {num_chunks}")
        self.num_chunks = num_chunks
        self.policy = policy
        # key -> record, kept beside the policy so that a lookup is one dict probe.
        self._records: dict[OffloadKey, SlotRecord] = {}
        # Popped from the end: slot 0 is handed out first.
        self._free: list[int] = list(range(num_chunks - 1, -1, -1))
        self.num_evictable = 0
        self.num_writing = 0
        self._events = EventLog(enable_events)
        self.prepare_read = self.prepare_load
        self.complete_read = self.complete_load
        self.prepare_write = self.prepare_store
        self.complete_write = self.complete_store

    # ----------------------------------------------------------------- queries

    def lookup(self, key: OffloadKey) -> LookupResult:
        record = self._records.get(key)
        if record is None:
            return LookupResult.MISS
        return LookupResult.HIT if record.ref_cnt >= 0 else LookupResult.HIT_PENDING

    def is_readable(self, key: OffloadKey) -> bool:
        record = self._records.get(key)
        return record is not None and record.ref_cnt >= 0

    def slot_of(self, key: OffloadKey) -> int | None:
        record = self._records.get(key)
        return None if record is None else record.slot

    def ref_count(self, key: OffloadKey) -> int | None:
        """None if ``key`` is not stored, -1 while it is written, else its pin count."""
        record = self._records.get(key)
        return None if record is None else record.ref_cnt

    def readable_prefix(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading ``keys`` are readable now."""
        records = self._records
        for count, key in enumerate(keys):
            record = records.get(key)
            if record is None or record.ref_cnt < 0:
                return count
        return len(keys)

    def slots(self) -> dict[OffloadKey, int]:
        """Every stored key (readable or being written) with its slot."""
        return {key: record.slot for key, record in self._records.items()}

    def readable_keys(self) -> list[OffloadKey]:
        return [key for key, record in self._records.items() if record.ref_cnt >= 0]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_stored(self) -> int:
        return len(self._records)

    @property
    def num_busy(self) -> int:
        """Slots that cannot be reused right now: being written or pinned."""
        return len(self._records) - self.num_evictable

    # ------------------------------------------------------------------ loads

    def prepare_load(self, keys: Sequence[OffloadKey]) -> LoadStoreSpec:
        """Pin readable ``keys`` against eviction; the spec lists their slots.

        A pin ranks nothing for the eviction policy: a request's load is a use of its
        prefix through :meth:`touch`, a cascade's read is none.

        Raises:
            StateError: a key is not stored or not yet readable (nothing is pinned).
        """
        records = self._records
        chosen: list[SlotRecord] = []
        for key in keys:
            record = records.get(key)
            if record is None or record.ref_cnt < 0:
                state = "not stored" if record is None else "still being written"
                raise StateError(f"cannot load key {format_key(key)}: it is {state}")
            chosen.append(record)
        for key, record in zip(keys, chosen, strict=True):
            if record.ref_cnt == 0:
                self.num_evictable -= 1
                self.policy.mark_non_evictable(key)
            record.ref_cnt += 1
        return LoadStoreSpec(chunk_ids=[record.slot for record in chosen])

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Release the pins ``prepare_load`` took.

        Raises:
            StateError: a key is not pinned (nothing is released).
        """
        records = self._records
        chosen: list[SlotRecord] = []
        for key in keys:
            record = records.get(key)
            if record is None or record.ref_cnt <= 0:
                raise StateError(
                    f"cannot complete a load of key {format_key(key)}: it is not pinned"
                )
            chosen.append(record)
        for key, record in zip(keys, chosen, strict=True):
            record.ref_cnt -= 1
            if record.ref_cnt == 0:
                self.num_evictable += 1
                self.policy.mark_evictable(key)

    def pin_readable(self, keys: Iterable[OffloadKey]) -> dict[OffloadKey, int]:
        """Pin each of ``keys`` that is readable now (others are skipped); their slots.

        Each key is pinned once even if it repeats. Released with :meth:`complete_load`.
        """
        records = self._records
        pinned: dict[OffloadKey, int] = {}
        for key in keys:
            record = records.get(key)
            if record is None or record.ref_cnt < 0 or key in pinned:
                continue
            if record.ref_cnt == 0:
                self.num_evictable -= 1
                self.policy.mark_non_evictable(key)
            record.ref_cnt += 1
            pinned[key] = record.slot
        return pinned

    def touch(self, keys: Sequence[OffloadKey], owner: Hashable | None = None) -> None:
        """A use of ``keys`` (head first): by ``owner`` (:meth:`CachePolicy.follow`) if
        one is named, else of their own (:meth:`CachePolicy.touch`)."""
        if owner is None:
            self.policy.touch(keys)
        else:
            self.policy.follow([key for key in keys if key in self._records], owner)

    # ----------------------------------------------------------------- stores

    def prepare_store(
        self,
        keys: Sequence[OffloadKey],
        protected: Collection[OffloadKey] | None = None,
        owner: Hashable | None = None,
    ) -> PrepareStoreOutput | None:
        """Allocate slots for the keys not stored yet, evicting others if needed.

        Keys in ``protected`` (by default the keys of this call; a caller passing more
        includes them) are never evicted for it. Returns None, changing nothing, when
        not enough slots can be freed. ``keys`` are a use of ``owner``'s prefix for
        the eviction policy (:meth:`CachePolicy.follow`); without an owner, the call's
        keys are a prefix of their own.
        """
        records = self._records
        ordered = list(dict.fromkeys(keys))
        to_store = [key for key in ordered if key not in records]
        if not to_store:
            self.policy.follow(ordered, object() if owner is None else owner)
            return PrepareStoreOutput(keys_to_store=[], store_spec=_EMPTY_SPEC, evicted_keys=[])
        evicted: list[OffloadKey] = []
        shortfall = len(to_store) - len(self._free)
        if shortfall > 0:
            if shortfall > self.num_evictable:
                return None
            guard = set(keys) if protected is None else protected
            victims = self.policy.evict(shortfall, protected=guard)
            if victims is None:
                return None
            for key, victim in victims:
                current = records.get(key)
                if current is None or current is not victim or current.ref_cnt != 0:
                    raise StateError(
                        f"eviction policy {type(self.policy).__name__} returned key "
                        f"{format_key(key)}, which is not evictable"
                    )
                del records[key]
                self._free.append(current.slot)
                evicted.append(key)
            self.num_evictable -= len(victims)
            self._events.add(evicted, self.medium, True, self.label)
        free = self._free
        slots: list[int] = []
        policy = self.policy
        for key in to_store:
            record = SlotRecord(free.pop())
            records[key] = record
            policy.insert(key, record)
            slots.append(record.slot)
        policy.follow(ordered, object() if owner is None else owner)
        self.num_writing += len(to_store)
        return PrepareStoreOutput(
            keys_to_store=to_store, store_spec=LoadStoreSpec(chunk_ids=slots), evicted_keys=evicted
        )

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> list[OffloadKey]:
        """Finish writes: on success the keys become readable, else their slots are freed.

        Keys that are not being written are ignored. Returns the keys that became
        readable.
        """
        records = self._records
        policy = self.policy
        done: list[OffloadKey] = []
        for key in keys:
            record = records.get(key)
            if record is None or record.ref_cnt != -1:
                continue
            self.num_writing -= 1
            if success:
                record.ref_cnt = 0
                self.num_evictable += 1
                policy.mark_evictable(key)
                done.append(key)
            else:
                del records[key]
                policy.remove(key)
                self._free.append(record.slot)
        self._events.add(done, self.medium, False, self.label)
        return done

    def detach(self, keys: Iterable[OffloadKey]) -> list[int]:
        """Forget keys being written without freeing their slots, which are returned.

        For a write that was given up while its I/O may still be running: the keys
        become misses at once, and the slots go back with :meth:`free_slots` only once
        the I/O has stopped.
        """
        slots: list[int] = []
        for key in keys:
            record = self._records.get(key)
            if record is None or record.ref_cnt != -1:
                continue
            del self._records[key]
            self.policy.remove(key)
            self.num_writing -= 1
            slots.append(record.slot)
        return slots

    def free_slots(self, slots: Iterable[int]) -> None:
        """Return slots taken out by :meth:`detach` or kept by :meth:`reset`."""
        self._free.extend(slots)

    # -------------------------------------------------------------- lifecycle

    def busy_slots(self) -> list[int]:
        """Slots being written or pinned now."""
        return [record.slot for record in self._records.values() if record.ref_cnt != 0]

    def reset(self, *, keep: Collection[int] = ()) -> None:
        """Forget every key; every slot but those in ``keep`` is free again.

        The caller (the manager's slot ledger) guarantees that nothing touches the
        other slots any more, and returns those in ``keep`` with :meth:`free_slots`.
        """
        self._events.add(self.readable_keys(), self.medium, True, self.label)
        self._records.clear()
        self.policy.clear()
        self._free = [slot for slot in range(self.num_chunks - 1, -1, -1) if slot not in keep]
        self.num_evictable = 0
        self.num_writing = 0

    def take_events(self) -> list[OffloadingEvent]:
        return self._events.take()
