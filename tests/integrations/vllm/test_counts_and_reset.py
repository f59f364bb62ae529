"""What vLLM's own tiering promises of its counters and of a cache reset, held by kvtier
under vLLM's real Scheduler and OffloadingConnector."""

from __future__ import annotations

import random
import time

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


def chunk_counts(engine, prefix: str) -> dict[str, tuple[float, float]]:
    """(chunk_queries, chunk_hits) by tier label, summed over the stats payloads the
    scheduler sent with its outputs (what vLLM's Prometheus logger adds up)."""
    sums: dict[str, list[float]] = {}
    for payload in engine.connector_stats:
        values = payload["data"]
        for index, name in enumerate((f"{prefix}chunk_queries", f"{prefix}chunk_hits")):
            for (label,), value in values.get(name, {}).items():
                sums.setdefault(label, [0.0, 0.0])[index] += value
    return {label: (queries, hits) for label, (queries, hits) in sums.items()}


def test_chunk_queries_and_hits_count_what_vllms_own_tiering_counts(
    make_engine, vllm_tiering, tmp_path
):
    # The same requests through kvtier and through vLLM's own TieringOffloadingSpec
    # (its scheduler side): a prompt is stored, then found on disk alone by a request
    # that waits several steps for its promotion, its keys looked up again each step.
    # vLLM counts each (request, tier, key) once, until the request is scheduled.
    def run(extra, root, prefix, **kwargs):
        engine = make_engine({**fs_config(root), **extra}, **kwargs)
        kvtier_manager = getattr(engine.manager, "kvtier", None)
        shared = prompt(7, 4)
        engine.add("first", [*shared, 5])
        engine.run()
        engine.drain_tiers()
        engine.scheduler.reset_prefix_cache(reset_connector=True)  # on disk only now
        engine.wipe_gpu()
        engine.add("second", [*shared, 6])
        waited = 0
        while "second" not in engine.cached_at_start:
            engine.step()
            waited += 1
            if kvtier_manager is not None:
                kvtier_manager.host.wait_for_completions_blocking(0.02)
            else:
                time.sleep(0.01)  # vLLM's tier threads need the time
        engine.run()
        engine.drain_tiers()
        assert engine.cached_at_start["second"] == 4 * TOKENS_PER_BLOCK
        return chunk_counts(engine, prefix), waited

    kvtier_counts, waited = run({}, tmp_path / "kvtier", "kvtier_tiering_")
    vllm_counts, _ = run(vllm_tiering, tmp_path / "vllm", "vllm:kv_offload_tiering_", copies=False)
    assert waited >= 2
    assert kvtier_counts == vllm_counts
    # The second request's four keys: a primary miss each, then a disk hit each.
    assert kvtier_counts["1:fs"][1] == 4
