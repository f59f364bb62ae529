"""A full primary tier under vLLM's real scheduler loses a prefix's tail before its
head, as vLLM's own tiering does, however many stores vLLM splits the prefix into."""

from __future__ import annotations

import random

import pytest

# vLLM's GPU block in these tests (the engine fixture's), and one chunk of the test
# model's KV cache: a primary tier of cpu_bytes_to_use / CHUNK_BYTES chunks.
TOKENS_PER_BLOCK = 16
CHUNK_BYTES = 4096


def prompt(seed: int, num_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(num_blocks * TOKENS_PER_BLOCK)]


# The first request's five blocks in one store, or two blocks a step (chunked prefill:
# three stores of one request).
STORE_SPLITS = pytest.mark.parametrize(
    "tokens_per_step", [2048, 2 * TOKENS_PER_BLOCK], ids=["one-store", "a-store-per-step"]
)


def head_left_after_pressure(make_engine, extra: dict, tokens_per_step: int, **kwargs) -> int:
    """Tokens of a five-block prefix still found after a second request stored two
    blocks into a primary tier of five chunks that the prefix filled."""
    engine = make_engine(
        {"cpu_bytes_to_use": 5 * CHUNK_BYTES, **extra},
        max_num_batched_tokens=tokens_per_step,
        **kwargs,
    )
    shared = prompt(1, 5)
    engine.add("first", [*shared, 5])
    engine.run()
    engine.add("second", [*prompt(2, 2), 5])
    engine.run()
    engine.wipe_gpu()  # vLLM's GPU prefix cache only: what is found comes from offloading
    engine.add("again", [*shared, 6])
    engine.run()
    return engine.cached_at_start["again"]


@pytest.mark.parametrize("policy", ["lru", "arc"])
@STORE_SPLITS
def test_a_full_primary_tier_evicts_a_prefixs_tail_before_its_head(
    make_engine, tokens_per_step, policy
):
    # Two slots for the second request: the prefix's chunks 3 and 4 go, 0-2 stay.
    kept = head_left_after_pressure(make_engine, {"eviction_policy": policy}, tokens_per_step)
    assert kept == 3 * TOKENS_PER_BLOCK


@STORE_SPLITS
def test_vllms_own_tiering_keeps_the_same_head(make_engine, vllm_tiering, tokens_per_step):
    # The reference the test above holds kvtier to, run through vLLM's own spec.
    kept = head_left_after_pressure(make_engine, vllm_tiering, tokens_per_step, copies=False)
    assert kept == 3 * TOKENS_PER_BLOCK
