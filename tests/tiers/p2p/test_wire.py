"""The wire format: frame headers, key lists and the fetch codec, and what they refuse."""

from __future__ import annotations

import struct

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.format import HEADER_BYTES, MAX_KEY_BYTES
from kvtier.tiers.p2p.errors import PeerClosed, ProtocolError
from kvtier.tiers.p2p.memory import channel_pair
from kvtier.tiers.p2p.wire import (
    CHUNK_META,
    CONTROL_BATCH_BYTES,
    FRAME,
    MAX_FETCH_KEYS,
    Kind,
    chunk_body_bytes,
    decode_fetch,
    decode_key_list,
    encode_fetch,
    encode_key_list,
    fetch_batches,
    key_batches,
    parse_frame_header,
    read_frame,
    send_frame,
)

HANG_S = 10

keys_st = st.lists(st.binary(min_size=1, max_size=64), max_size=50)


# -------------------------------------------------------------------- frames


@pytest.mark.parametrize("kind", list(Kind))
def test_a_frame_header_round_trips_its_kind_and_length(kind):
    assert parse_frame_header(FRAME.pack(kind, 1 << 33)) == (kind, 1 << 33)


def test_a_frame_header_with_a_nonzero_pad_byte_is_refused():
    header = bytearray(FRAME.pack(Kind.FETCH, 8))
    header[2] = 1
    with pytest.raises(ProtocolError, match="malformed frame header"):
        parse_frame_header(header)


def test_a_frame_header_of_an_unknown_kind_is_refused():
    with pytest.raises(ProtocolError, match="unknown frame kind 99"):
        parse_frame_header(FRAME.pack(99, 0))


def test_a_frame_header_longer_than_the_limit_is_refused():
    with pytest.raises(ProtocolError, match="a CHUNK frame of 1025 bytes, at most 1024"):
        parse_frame_header(FRAME.pack(Kind.CHUNK, 1025), max_body=1024)


@pytest.mark.anyio
async def test_a_sent_frame_is_read_back_whole():
    a, b = channel_pair()
    with anyio.fail_after(HANG_S):
        await send_frame(a, Kind.ANNOUNCE, b"body")
        assert await read_frame(b, 64) == (Kind.ANNOUNCE, bytearray(b"body"))


@pytest.mark.anyio
async def test_an_oversized_frame_is_refused_from_its_header_alone():
    a, b = channel_pair()
    # Only the header is sent: reading on for the body would wait forever.
    await a.send(FRAME.pack(Kind.HELLO, 1 << 62))
    with anyio.fail_after(HANG_S), pytest.raises(ProtocolError, match="at most 256"):
        await read_frame(b, 256)


@pytest.mark.anyio
async def test_a_frame_cut_short_by_the_peer_raises_peer_closed():
    a, b = channel_pair()
    await a.send(FRAME.pack(Kind.ANNOUNCE, 10) + b"short")
    a.close()
    with anyio.fail_after(HANG_S), pytest.raises(PeerClosed):
        await read_frame(b, 64)


def test_a_chunk_body_holds_its_meta_the_chunk_header_and_the_row():
    assert chunk_body_bytes(1 << 20) == CHUNK_META.size + HEADER_BYTES + (1 << 20)


# ----------------------------------------------------------------- key lists


@given(keys_st)
def test_a_key_list_round_trips(keys):
    assert decode_key_list(encode_key_list(keys)) == keys


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"\0\0", "truncated key list"),
        (b"\0\0\0\2" + b"\0\1a", "truncated key list"),
        (b"\0\0\0\1\0\5ab", "malformed key"),
        (b"\0\0\0\1\0\0\0", "malformed key"),
        (encode_key_list([b"a"]) + b"!", "bytes after a key list"),
        (b"\xff\xff\xff\xff", "truncated key list"),
    ],
    ids=["no-count", "fewer-keys", "key-past-end", "empty-key", "trailing", "huge-count"],
)
def test_a_malformed_key_list_is_refused(body, problem):
    with pytest.raises(ProtocolError, match=problem):
        decode_key_list(body)


def test_a_key_longer_than_a_chunk_header_can_name_is_refused():
    body = struct.pack(">IH", 1, MAX_KEY_BYTES + 1) + b"k" * (MAX_KEY_BYTES + 1)
    with pytest.raises(ProtocolError, match="malformed key"):
        decode_key_list(body)


def test_a_key_list_longer_than_allowed_is_refused():
    with pytest.raises(ProtocolError, match="3 keys, at most 2"):
        decode_key_list(encode_key_list([b"a", b"b", b"c"]), max_keys=2)


@given(keys_st, st.integers(70, 400))
def test_key_batches_keep_the_order_and_each_fits_its_byte_limit(keys, limit):
    batches = list(key_batches(keys, limit))
    assert [key for batch in batches for key in batch] == keys
    for batch in batches:
        assert batch and len(encode_key_list(batch)) <= limit


# ------------------------------------------------------------ fetch requests


@given(st.integers(0, (1 << 32) - 1), keys_st.filter(bool))
def test_a_fetch_request_round_trips(request_id, keys):
    assert decode_fetch(encode_fetch(request_id, keys)) == (request_id, keys)


def test_a_fetch_request_for_no_keys_is_refused():
    with pytest.raises(ProtocolError, match="no keys"):
        decode_fetch(encode_fetch(7, []))


def test_a_truncated_fetch_request_is_refused():
    with pytest.raises(ProtocolError, match="truncated fetch"):
        decode_fetch(b"\0\0")


def test_a_fetch_request_for_more_keys_than_allowed_is_refused():
    body = encode_fetch(1, [b"k%d" % i for i in range(MAX_FETCH_KEYS + 1)])
    with pytest.raises(ProtocolError, match=f"at most {MAX_FETCH_KEYS}"):
        decode_fetch(body)


@pytest.mark.parametrize(("count", "key_bytes"), [(3000, 8), (2000, 36), (50, 3000)])
def test_fetch_batches_keep_every_position_once_and_each_request_within_the_limits(
    count, key_bytes
):
    keys = [i.to_bytes(4, "big") * (key_bytes // 4) for i in range(count)]
    positions = list(range(0, count, 2)) + list(range(1, count, 2))
    batches = fetch_batches(keys, positions)
    assert [p for batch in batches for p in batch] == positions
    for batch in batches:
        assert len(batch) <= MAX_FETCH_KEYS
        assert len(encode_fetch(0, [keys[p] for p in batch])) <= CONTROL_BATCH_BYTES
