"""The s3 tier's request bodies: views of the primary row, read and streamed uncopied."""

from __future__ import annotations

import pytest

from kvtier.tiers.s3.body import RequestBody, split_parts

pytestmark = pytest.mark.anyio


def test_a_body_reads_as_one_buffer_without_joining_its_parts():
    header, row = memoryview(bytearray(b"H" * 10)), memoryview(bytearray(range(256)) * 4)
    whole = bytes(header) + bytes(row)
    body = RequestBody((header, row))
    assert len(body) == len(whole)
    assert body.read(7) == whole[:7]
    assert body.read(100) == whole[7:107]
    assert body.tell() == 107
    assert body.read() == whole[107:]
    assert body.read(5) == b""
    body.seek(3)
    assert body.read(9) == whole[3:12]
    body.seek(-4, 2)
    assert body.read() == whole[-4:]


async def test_a_body_streams_its_own_memory():
    header, row = memoryview(bytearray(8)), memoryview(bytearray(64))
    pieces = [piece async for piece in RequestBody((header, row))]
    assert [piece.obj for piece in pieces] == [header.obj, row.obj]  # the buffers, no copy


def test_the_parts_of_a_chunk_are_slices_of_its_header_and_row():
    header, row = memoryview(bytearray(b"H" * 16)), memoryview(bytearray(range(100)))
    parts = split_parts(header, row, 48)
    assert [sum(len(view) for view in part) for part in parts] == [48, 48, 20]
    assert b"".join(bytes(view) for part in parts for view in part) == bytes(header) + bytes(row)
    assert all(view.obj is row.obj for part in parts[1:] for view in part)  # no copy
