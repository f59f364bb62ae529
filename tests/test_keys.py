import pytest

from kvtier import key_block_hash, key_group_idx, make_offload_key


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
