"""What vLLM's own tiering promises of its counters and of a cache reset, held by kvtier
under vLLM's real Scheduler and OffloadingConnector."""

from __future__ import annotations

import random

# vLLM's GPU block in these tests (the engine fixture's).
TOKENS_PER_BLOCK = 16


def prompt(seed: int, num_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(num_blocks * TOKENS_PER_BLOCK)]


def fs_config(root, **tier) -> dict:
    return {
        "cpu_bytes_to_use": 256 * 2 * 2048,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), **tier}],
    }


def test_a_cache_reset_lets_a_pressured_tiers_next_cascade_through(make_engine, tmp_path):
    # One cascade takes far longer than a microsecond per MiB: the fs tier is pressured
    # from then on, and its average decays over tens of seconds. vLLM resets every
    # tier's back-pressure with the cache; so does kvtier.
    pressured = {"policy": "drop", "warmup": 1, "high_water": 1e-6, "low_water": 1e-7}
    engine = make_engine(fs_config(tmp_path / "fs", backpressure=pressured))
    diagnostics = engine.manager.kvtier.diagnostics

    def written() -> dict[str, float]:
        return diagnostics.tier_stats()["1:fs"]

    for name, seed in [("first", 1), ("second", 2)]:
        engine.add(name, [*prompt(seed, 4), 5])
        engine.run()
        engine.drain_tiers()
    before = written()
    assert before["stores_dropped"] >= 1
    assert engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.add("third", [*prompt(3, 4), 5])
    engine.run()
    engine.drain_tiers()
    after = written()
    assert after["bytes_written"] > before["bytes_written"]
