"""The region's rows as secondary tiers get them: by slot, each tracked while referenced."""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy

__all__ = ["PrimaryView"]


class PrimaryView:
    """Whole rows of the region, by slot: ``view[chunk_id]`` is that row's memoryview.

    Python's ``memoryview`` cannot hand out a row of a 2-D view, so secondary tiers get
    this accessor; each row it returns is a writable 1-D memoryview of
    ``row_bytes`` bytes over the shared mapping (no copy).

    Every row handed out is tracked until the last reference to it is gone: slices of
    it, tensors and arrays over it, and a thread inside ``os.preadv`` with it all keep
    it alive. :meth:`in_use` says whether any such reference to a slot is left, which is
    how the manager knows that I/O a tier abandoned (a thread its job did not wait for)
    has really stopped touching a slot before the slot is reused.
    """

    __slots__ = ("_flat", "_live", "_lock", "_refs", "num_rows", "row_bytes")

    def __init__(self, flat: memoryview, num_rows: int, row_bytes: int) -> None:
        self._flat = flat
        self.num_rows = num_rows
        self.row_bytes = row_bytes
        # Live rows handed out, per slot, kept by weak references whose callbacks count
        # them down. The callbacks run on whichever thread drops the last reference.
        self._live = [0] * num_rows
        # By the id of the weak reference (arrays hash by value, so theirs cannot).
        self._refs: dict[int, tuple[weakref.ref[numpy.ndarray[Any, Any]], int]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, chunk_id: int) -> memoryview:
        if not 0 <= chunk_id < self.num_rows:
            raise IndexError(f"chunk_id {chunk_id} is outside [0, {self.num_rows})")
        # A distinct owner object per row handed out: every view derived from the row
        # keeps it alive, and it takes weak references (a slice of the region's own
        # memoryview would not tell one row's users from another's). About 2 us.
        owner = numpy.frombuffer(self._flat, numpy.uint8, self.row_bytes, chunk_id * self.row_bytes)
        ref = weakref.ref(owner, self._row_released)
        with self._lock:
            self._refs[id(ref)] = (ref, chunk_id)
            self._live[chunk_id] += 1
        return owner.data

    def _row_released(self, ref: weakref.ref[numpy.ndarray[Any, Any]]) -> None:
        with self._lock:
            entry = self._refs.pop(id(ref), None)
            if entry is not None:
                self._live[entry[1]] -= 1

    def memory_range(self) -> tuple[int, int]:
        """The address of the region's first row and the length of all rows: row
        ``chunk_id`` starts ``chunk_id * row_bytes`` after it. For a client that
        registers the memory it moves bytes through (RDMA, a transfer engine); the
        rows' tracking is the rows', so a tier still takes each row it moves from
        ``view[chunk_id]`` and holds it while the client may touch it."""
        if not self.num_rows:
            return 0, 0
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._flat))
        return address, self.num_rows * self.row_bytes

    def as_rows(self) -> memoryview:
        """The whole region as one 2-D memoryview, shaped ``(num_rows, row_bytes)``:
        ``strides[0]`` is the row length and the first index a slot. For a tier written
        against an interface that takes the region at once (vLLM's tier plugins). Its
        rows are not tracked: whoever hands it out takes ``view[chunk_id]`` for each
        slot the holder may touch and keeps it while it may."""
        return self._flat.cast("B", (self.num_rows, self.row_bytes))

    def in_use(self, chunk_id: int) -> bool:
        """Whether a row of ``chunk_id`` handed out earlier is still referenced."""
        return self._live[chunk_id] > 0

    def slots_in_use(self) -> list[int]:
        """The slots of which a row handed out earlier is still referenced."""
        with self._lock:
            return [chunk_id for chunk_id, live in enumerate(self._live) if live]

    def __iter__(self) -> Iterator[memoryview]:
        for chunk_id in range(self.num_rows):
            yield self[chunk_id]
