import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from kvtier import key_block_hash, key_group_idx, make_offload_key, prefix_keys

FIRST_KEY_HEX = "6d2dc40f96746b995289ecdc986182a1b07f1270054da104bf5989ed65cdee0d00000000"


def test_key_is_block_hash_then_big_endian_group_index():
    key = make_offload_key(b"\xaa" * 8, 258)
    assert key == b"\xaa" * 8 + b"\x00\x00\x01\x02"


def test_key_round_trips_hash_and_group():
    key = make_offload_key(b"hash-bytes", 7)
    assert key_block_hash(key) == b"hash-bytes"
    assert key_group_idx(key) == 7


def test_default_group_is_zero():
    assert key_group_idx(make_offload_key(b"h")) == 0


@pytest.mark.parametrize("group", [-1, 2**32])
def test_group_index_must_fit_four_bytes(group):
    with pytest.raises(ValueError, match="group_idx"):
        make_offload_key(b"h", group)


def test_block_hash_must_be_bytes():
    with pytest.raises(TypeError, match="block_hash"):
        make_offload_key("text", 0)  # type: ignore[arg-type]


def test_empty_block_hash_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        make_offload_key(b"", 0)


def test_too_short_key_is_rejected_by_helpers():
    with pytest.raises(ValueError, match="group index"):
        key_group_idx(b"\x00\x01")  # type: ignore[arg-type]


# ----------------------------------------------------------------- prefix_keys

tokens_st = st.lists(st.integers(min_value=0, max_value=200_000), max_size=80)
chunk_st = st.integers(min_value=1, max_value=9)


def test_prefix_keys_are_pinned_to_their_encoding():
    # Keys name chunks in caches shared by processes, nodes and releases: the encoding
    # may only change together with its version tag, which this value pins.
    [first, second] = prefix_keys(range(8), 4, salt="model-a/fp32")
    assert first.hex() == FIRST_KEY_HEX
    assert key_group_idx(second) == 0 and len(key_block_hash(second)) == 32


@given(tokens=tokens_st, chunk=chunk_st)
def test_one_key_per_full_chunk_the_partial_chunk_dropped(tokens, chunk):
    keys = prefix_keys(tokens, chunk)
    assert len(keys) == len(tokens) // chunk
    assert len(set(keys)) == len(keys)


@given(shared=tokens_st, tail_a=tokens_st, tail_b=tokens_st, chunk=chunk_st)
def test_prompts_share_exactly_the_keys_of_their_shared_full_chunks(shared, tail_a, tail_b, chunk):
    a, b = shared + tail_a, shared + tail_b
    keys_a, keys_b = prefix_keys(a, chunk), prefix_keys(b, chunk)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    same = common // chunk
    assert keys_a[:same] == keys_b[:same]
    assert set(keys_a[same:]).isdisjoint(keys_b[same:])


@given(
    tokens=st.lists(st.integers(0, 1000), min_size=1, max_size=80), chunk=chunk_st, data=st.data()
)
def test_one_changed_token_changes_its_chunk_and_every_later_key(tokens, chunk, data):
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] += 1
    before, after = prefix_keys(tokens, chunk), prefix_keys(changed, chunk)
    untouched = position // chunk
    assert before[:untouched] == after[:untouched]
    assert set(before[untouched:]).isdisjoint(after[untouched:])


@given(
    tokens=st.lists(st.integers(0, 1000), min_size=9, max_size=60),
    chunk=chunk_st,
    one=st.binary(max_size=8),
    other=st.binary(max_size=8),
)
def test_another_salt_or_extra_changes_every_key(tokens, chunk, one, other):
    assume(one != other)
    for name in ("salt", "extra"):
        a = prefix_keys(tokens, chunk, **{name: one})
        b = prefix_keys(tokens, chunk, **{name: other})
        assert set(a).isdisjoint(b), name


def test_salt_and_extra_are_not_interchangeable():
    assert set(prefix_keys(range(8), 4, salt="x")).isdisjoint(prefix_keys(range(8), 4, extra="x"))


def test_str_salt_is_its_utf8_bytes_and_no_extra_is_empty_extra():
    assert prefix_keys(range(8), 4, salt="modèle") == prefix_keys(
        range(8), 4, salt="modèle".encode()
    )
    assert prefix_keys(range(8), 4, extra=None) == prefix_keys(range(8), 4, extra=b"")


@given(head=tokens_st, tail=tokens_st, chunk=chunk_st, salt=st.binary(max_size=6))
def test_parent_continues_a_chain_exactly(head, tail, chunk, salt):
    head = head[: len(head) // chunk * chunk]
    assume(head)
    first = prefix_keys(head, chunk, salt=salt)
    rest = prefix_keys(tail, chunk, salt=salt, parent=first[-1])
    assert prefix_keys(head + tail, chunk, salt=salt) == first + rest


def test_group_index_changes_only_the_group_part():
    group0 = prefix_keys(range(8), 4)
    group3 = prefix_keys(range(8), 4, group_idx=3)
    assert [key_block_hash(k) for k in group0] == [key_block_hash(k) for k in group3]
    assert {key_group_idx(k) for k in group3} == {3}


def test_tensors_and_arrays_of_token_ids_give_the_same_keys():
    tokens = list(range(100, 140))
    expected = prefix_keys(tokens, 16)
    assert prefix_keys(torch.tensor(tokens), 16) == expected
    assert prefix_keys(np.array(tokens, dtype=np.int32), 16) == expected
    assert prefix_keys(tuple(np.int64(t) for t in tokens), 16) == expected


def test_keys_are_the_same_in_another_process_with_another_hash_seed():
    script = (
        "import kvtier; "
        "print(','.join(k.hex() for k in kvtier.prefix_keys("
        "range(1000, 1100), 16, salt='m', extra=b'lora', group_idx=1)))"
    )
    here = ",".join(
        k.hex() for k in prefix_keys(range(1000, 1100), 16, salt="m", extra=b"lora", group_idx=1)
    )
    # Another seed than this process's (random unless set): str hashes differ between them.
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONHASHSEED": seed},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == here


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"chunk_tokens": 0}, ValueError, "chunk_tokens must be >= 1"),
        ({"chunk_tokens": 2.0}, TypeError, "chunk_tokens must be an int"),
        ({"token_ids": [1, 2.5]}, TypeError, r"token_ids\[1\] is 2.5 \(float\)"),
        ({"token_ids": ["1"]}, TypeError, r"token_ids\[0\] .*must be ints"),
        ({"token_ids": [True]}, TypeError, r"token_ids\[0\] is True"),
        ({"token_ids": torch.tensor([0.5])}, TypeError, "must be ints"),
        ({"token_ids": [3, -1]}, ValueError, r"token_ids\[1\] is -1"),
        ({"token_ids": [2**64]}, ValueError, "must be in"),
        ({"salt": 5}, TypeError, "salt must be bytes or str"),
        ({"extra": 1.0}, TypeError, "extra must be bytes or str"),
        ({"parent": b"\x00"}, ValueError, "group index"),
        ({"parent": "abcdefgh"}, TypeError, "parent must be an OffloadKey"),
        ({"group_idx": -1}, ValueError, "group_idx"),
    ],
)
def test_prefix_keys_rejects_bad_input_by_name(kwargs, error, message):
    arguments = {"token_ids": [1, 2, 3, 4], "chunk_tokens": 2, **kwargs}
    with pytest.raises(error, match=message):
        prefix_keys(**arguments)
