"""The benchmarks' chunk patterns: every loaded byte is checked, by digest or by word."""

from __future__ import annotations

import pytest
import torch
from common import Patterns

CHUNK_WORDS = 4096


@pytest.fixture
def cache() -> torch.Tensor:
    return torch.zeros((8, CHUNK_WORDS), dtype=torch.int64)


def keys(count: int) -> list[bytes]:
    return [bytes([i + 1]) * 16 for i in range(count)]


def test_blocks_written_check_clean_and_one_flipped_bit_is_caught(cache):
    patterns = Patterns([cache], seed=0)
    patterns.write(keys(4), [0, 1, 2, 3])
    assert patterns.wrong(keys(4), [0, 1, 2, 3]) == 0
    cache[2, CHUNK_WORDS - 1] ^= 1 << 40
    assert patterns.wrong(keys(4), [0, 1, 2, 3]) == 1


def test_a_chunk_served_under_another_key_or_in_another_block_is_wrong(cache):
    patterns = Patterns([cache], seed=0)
    patterns.write(keys(2), [0, 1])
    # Block 1 holds the second key's chunk: read back as the first key's, it is wrong.
    assert patterns.wrong(keys(2)[:1], [1]) == 1
    # The same key's chunk moved to a block of its own (a load) is right.
    cache[5].copy_(cache[0])
    assert patterns.wrong(keys(1), [5]) == 0


def test_keys_written_by_another_pattern_object_are_compared_word_by_word(cache):
    writer, checker = Patterns([cache], seed=7), Patterns([cache], seed=7)
    writer.write(keys(3), [0, 1, 2])
    assert checker.wrong(keys(3), [0, 1, 2]) == 0
    cache[1, 0] += 1
    assert checker.wrong(keys(3), [0, 1, 2]) == 1
