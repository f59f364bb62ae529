"""Scheduler overhead: manager calls with no secondary tier, per second.

``lookup`` hits over a full primary tier, and one-chunk ``prepare_store`` +
``complete_store`` cycles that each also evict (the primary tier stays full). These are
the calls a serving engine makes for every chunk of every request, on its scheduling
thread. Prints a line, then one JSON line.

    python benchmarks/scheduler.py
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

from kvtier import OffloadingConfig, OffloadingSpecFactory, ReqContext, make_offload_key


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
    return {"lookups_per_s": lookups_per_s, "store_cycles_per_s": cycles_per_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lookups", type=int, default=2_000_000)
    parser.add_argument("--store-cycles", type=int, default=300_000)
    args = parser.parse_args()
    figures = measure_scheduler(args.lookups, args.store_cycles)
    print(
        f"scheduler: {figures['lookups_per_s'] / 1e6:.2f} M lookups/s, "
        f"{figures['store_cycles_per_s'] / 1e3:.0f} k store cycles/s"
    )
    print(json.dumps({name: round(value, 1) for name, value in figures.items()}))


if __name__ == "__main__":
    main()
