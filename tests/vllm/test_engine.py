"""kvtier under vLLM's real Scheduler and OffloadingConnector, on CPU tensors.

Each test stores prompts through vLLM, empties vLLM's GPU prefix cache (and zeroes the
KV tensors), and runs requests sharing those prompts: every token vLLM then finds
computed was loaded by kvtier, and each one is compared byte for byte with what was
computed for it.
"""

from __future__ import annotations

import random

import pytest

# vLLM's GPU block in these tests (the engine fixture's).
TOKENS_PER_BLOCK = 16
PRIMARY_BYTES = 256 * 2 * 2048  # 256 GPU blocks of both layers


def prompt(seed: int, num_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(num_blocks * TOKENS_PER_BLOCK)]


def tier_config(kind: str, tmp_path) -> dict:
    if kind == "primary":
        return {"cpu_bytes_to_use": PRIMARY_BYTES}
    return {
        "cpu_bytes_to_use": PRIMARY_BYTES,
        "secondary_tiers": [
            {"type": "fs", "root_dir": str(tmp_path / "fs"), "n_read_threads": 2, "n_write_threads": 2}
        ],
    }


@pytest.mark.parametrize("events", [False, True], ids=["no-events", "events"])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize("tiers", ["primary", "fs"])
def test_a_stored_prompt_loads_back_byte_exact(make_engine, tmp_path, tiers, blocks_per_chunk, events):
    extra = {**tier_config(tiers, tmp_path), "blocks_per_chunk": blocks_per_chunk}
    engine = make_engine(extra, events=events)
    shared = prompt(1, 8)
    engine.add("first", shared + [5, 6, 7])
    engine.run()
    if tiers == "fs":
        engine.drain_tiers()
        # Empty kvtier's primary tier too: the chunks must come back from the disk.
        engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.wipe_gpu()
    engine.add("second", shared + [9, 9, 9, 9])
    engine.run()
    assert engine.cached_at_start["second"] == 8 * TOKENS_PER_BLOCK
    assert engine.finished == {"first", "second"}
