"""Scheduler overhead: manager calls with no secondary tier, per second.

``lookup`` hits over a full primary tier, and one-chunk ``prepare_store`` +
``complete_store`` cycles that each also evict (the primary tier stays full). These are
the calls a serving engine makes for every chunk of every request, on its scheduling
thread. Prints a line, then one JSON line.

The interpreter's own speed moves these figures more than anything else (the same code
measured 2.1 M and 0.6 M lookups/s on two days of the same VM class), so the run also
measures its floor: the rate of a call that takes an ``RLock`` and reads one dictionary
entry, the least a thread-safe lookup can do. ``lookup_share_of_floor`` is kvtier's
rate over that one, comparable between machines.

    python benchmarks/scheduler.py
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid

from kvtier import (
    OffloadingConfig,
    OffloadingSpecFactory,
    OffloadKey,
    ReqContext,
    make_offload_key,
)


def measure_scheduler(
    lookups: int = 2_000_000, store_cycles: int = 300_000, *, stored: int = 100_000
) -> dict[str, float]:
    """Lookup hits and store cycles per second over a primary tier of ``stored`` chunks."""
    config = OffloadingConfig(
        engine_id=f"bench-sched-{uuid.uuid4().hex[:8]}",
        kv_bytes_per_block=4096,
        extra_config={"cpu_bytes_to_use": 4096 * stored},
    )
    spec = OffloadingSpecFactory.create_spec(config)
    manager = spec.get_manager()
    req = ReqContext("bench")
    keys = [make_offload_key(i.to_bytes(32, "big")) for i in range(stored)]
    for first in range(0, stored, 1000):
        batch = keys[first : first + 1000]
        manager.prepare_store(batch, req)
        manager.complete_store(batch, req)
    lookup = manager.lookup
    probe_keys = (keys * (lookups // stored + 1))[:lookups]
    started = time.perf_counter()
    for key in probe_keys:
        lookup(key, req)
    lookups_per_s = lookups / (time.perf_counter() - started)
    fresh = [[make_offload_key((stored + i).to_bytes(32, "big"))] for i in range(store_cycles)]
    prepare, complete = manager.prepare_store, manager.complete_store
    started = time.perf_counter()
    for one in fresh:
        prepare(one, req)
        complete(one, req)
    cycles_per_s = store_cycles / (time.perf_counter() - started)
    spec.shutdown()
    floor = measure_floor(probe_keys)
    return {
        "lookups_per_s": lookups_per_s,
        "store_cycles_per_s": cycles_per_s,
        "floor_lookups_per_s": floor,
        "lookup_share_of_floor": lookups_per_s / floor,
    }


class _Floor:
    """The least a thread-safe lookup does: take a lock, read one dictionary entry."""

    def __init__(self, keys: list[OffloadKey]) -> None:
        self.lock = threading.RLock()
        self.records = dict.fromkeys(keys, 0)

    def lookup(self, key: OffloadKey, req: ReqContext) -> int | None:
        with self.lock:
            return self.records.get(key)


def measure_floor(keys: list[OffloadKey]) -> float:
    """Calls per second of :class:`_Floor`'s lookup over ``keys``, as kvtier's are timed."""
    lookup = _Floor(keys).lookup
    req = ReqContext("floor")
    started = time.perf_counter()
    for key in keys:
        lookup(key, req)
    return len(keys) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lookups", type=int, default=2_000_000)
    parser.add_argument("--store-cycles", type=int, default=300_000)
    args = parser.parse_args()
    figures = measure_scheduler(args.lookups, args.store_cycles)
    print(
        f"scheduler: {figures['lookups_per_s'] / 1e6:.2f} M lookups/s, "
        f"{figures['store_cycles_per_s'] / 1e3:.0f} k store cycles/s; a bare locked "
        f"lookup {figures['floor_lookups_per_s'] / 1e6:.2f} M/s here "
        f"(kvtier {figures['lookup_share_of_floor']:.2f} of it)"
    )
    print(json.dumps({name: round(value, 1) for name, value in figures.items()}))


if __name__ == "__main__":
    main()
