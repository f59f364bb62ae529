"""The stored chunk format, read and written through kvtier.format as outside tools do:
the header as documented, every field checked, the names, namespace.json, and files a
real fs tier wrote or will serve."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
import torch
import xxhash
from helpers import keys, store_all, tiering_config

from kvtier import KVTier, OffloadKey
from kvtier.format import (
    CHUNK_SUFFIX,
    HEADER_BYTES,
    KEY_OFFSET,
    MAGIC,
    MAX_KEY_BYTES,
    NAMESPACE_FILE,
    TEMP_SUFFIX,
    VERSION,
    ChunkFormat,
    NamespaceDescription,
    chunk_name,
    chunk_path,
    key_of,
    model_slug,
    namespace_directory,
    temp_name,
)

NAMESPACE = "kvtier/v1;model=m;dtype=bf16;tokens=16;world=1;column=4096;chunk=4096"
[KEY] = keys("format", 1)
PAYLOAD = bytes(range(256)) * 16


def chunk(key: OffloadKey = KEY, payload: bytes = PAYLOAD, namespace: str = NAMESPACE) -> bytes:
    """A whole stored chunk: header page, then payload."""
    return bytes(ChunkFormat(namespace).header(key, memoryview(payload))) + payload


def verify(data: bytes, key: OffloadKey = KEY, payload_bytes: int = len(PAYLOAD)) -> str | None:
    view = memoryview(data)
    return ChunkFormat(NAMESPACE).verify(view[:HEADER_BYTES], key, view[-payload_bytes:])


# ------------------------------------------------------------------ header


def test_a_chunk_written_verifies_and_names_its_key():
    data = chunk()
    assert len(data) == HEADER_BYTES + len(PAYLOAD)
    assert verify(data) is None
    assert ChunkFormat.stored_key(data[:HEADER_BYTES]) == KEY


def test_the_header_holds_the_documented_fields_at_their_offsets():
    data = chunk()
    magic, version, key_len, payload_len, checksum, digest = struct.unpack_from(
        "<8sHHQQ16s", data, 0
    )
    (header_sum,) = struct.unpack_from("<Q", data, 44)
    assert (magic, version, key_len, payload_len) == (MAGIC, VERSION, len(KEY), len(PAYLOAD))
    assert checksum == xxhash.xxh3_64_intdigest(PAYLOAD) == ChunkFormat.checksum(PAYLOAD)
    assert digest == hashlib.sha256(NAMESPACE.encode()).digest()[:16]
    assert digest == ChunkFormat(NAMESPACE).digest
    assert header_sum == xxhash.xxh3_64_intdigest(data[:44] + KEY)
    assert data[52:KEY_OFFSET] == bytes(KEY_OFFSET - 52)
    assert data[KEY_OFFSET : KEY_OFFSET + len(KEY)] == KEY
    assert data[KEY_OFFSET + len(KEY) : HEADER_BYTES] == bytes(HEADER_BYTES - KEY_OFFSET - len(KEY))
    assert data[HEADER_BYTES:] == PAYLOAD


def test_packing_into_a_used_buffer_writes_the_same_header():
    used = bytearray(b"\xff" * (HEADER_BYTES + 10))
    ChunkFormat(NAMESPACE).pack_header(used, KEY, memoryview(PAYLOAD))
    assert bytes(used[:HEADER_BYTES]) == chunk()[:HEADER_BYTES]


# Each field's bytes, and the reasons a flipped byte in it may be rejected for. The
# header checksum is checked before what it covers, so most damage ends there.
FIELDS = {
    "magic": (0, 8, {"not a kvtier chunk"}),
    "version": (8, 10, {"format version 254, expected 1", "format version 65281, expected 1"}),
    "key length": (10, 12, {"corrupt header", "header checksum mismatch"}),
    "payload length": (12, 20, {"header checksum mismatch"}),
    "payload checksum": (20, 28, {"header checksum mismatch"}),
    "namespace digest": (28, 44, {"header checksum mismatch"}),
    "header checksum": (44, 52, {"header checksum mismatch"}),
    "key": (KEY_OFFSET, KEY_OFFSET + len(KEY), {"header checksum mismatch"}),
    "payload": (HEADER_BYTES, HEADER_BYTES + len(PAYLOAD), {"payload checksum mismatch"}),
}


@pytest.mark.parametrize("field", FIELDS)
def test_a_flipped_byte_anywhere_in_a_field_is_rejected(field):
    start, end, reasons = FIELDS[field]
    for offset in range(start, end):
        damaged = bytearray(chunk())
        damaged[offset] ^= 0xFF
        problem = verify(bytes(damaged))
        assert problem is not None, f"{field}: byte {offset} flipped and still served"
        assert problem in reasons, (field, offset, problem)


def test_a_header_of_another_namespace_is_foreign():
    assert verify(chunk(namespace=NAMESPACE + "x")) == "foreign namespace"


def test_a_chunk_asked_for_under_another_key_is_refused():
    [other] = keys("format-other", 1)
    assert verify(chunk(), key=other) == "another key"


def test_a_payload_of_another_length_is_refused():
    data = chunk(payload=PAYLOAD[:-1]) + b"\0"
    assert verify(data) == f"payload of {len(PAYLOAD) - 1} bytes, expected {len(PAYLOAD)}"


def test_a_truncated_header_is_refused():
    data = chunk()
    format_ = ChunkFormat(NAMESPACE)
    short = memoryview(data)[: HEADER_BYTES - 1]
    assert format_.verify(short, KEY, memoryview(PAYLOAD)) == "truncated header"


def test_a_key_too_long_for_the_header_is_refused_when_packing():
    with pytest.raises(ValueError, match="does not fit"):
        ChunkFormat(NAMESPACE).header(OffloadKey(b"k" * (MAX_KEY_BYTES + 1)), memoryview(b""))
    longest = OffloadKey(b"k" * MAX_KEY_BYTES)
    assert verify(chunk(key=longest), key=longest) is None


def test_what_is_not_a_kvtier_header_names_no_key():
    assert ChunkFormat.stored_key(b"x" * HEADER_BYTES) is None
    assert ChunkFormat.stored_key(chunk()[:10]) is None


# ------------------------------------------------------------------ files


@pytest.mark.parametrize(
    ("cut", "problem"),
    [
        (slice(None, -1), f"{HEADER_BYTES + len(PAYLOAD) - 1} bytes, expected"),
        (slice(None, HEADER_BYTES), f"{HEADER_BYTES} bytes, expected"),
        (slice(None, 100), "100 bytes, expected"),
    ],
)
def test_a_truncated_file_is_refused(tmp_path, cut, problem):
    path = tmp_path / chunk_name(KEY)
    path.write_bytes(chunk()[cut])
    assert ChunkFormat(NAMESPACE).verify_file(path, len(PAYLOAD)) == (
        f"{problem} {HEADER_BYTES + len(PAYLOAD)}"
    )


def test_a_file_with_trailing_bytes_is_refused(tmp_path):
    path = tmp_path / chunk_name(KEY)
    path.write_bytes(chunk() + b"x")
    size = HEADER_BYTES + len(PAYLOAD)
    assert ChunkFormat(NAMESPACE).verify_file(path, len(PAYLOAD)) == (
        f"{size + 1} bytes, expected {size}"
    )


def test_a_file_is_verified_for_the_key_its_name_gives(tmp_path):
    [other] = keys("format-renamed", 1)
    sound, renamed = tmp_path / chunk_name(KEY), tmp_path / chunk_name(other)
    sound.write_bytes(chunk())
    renamed.write_bytes(chunk())
    (tmp_path / f"not-a-key{CHUNK_SUFFIX}").write_bytes(chunk())
    format_ = ChunkFormat(NAMESPACE)
    assert format_.verify_file(sound, len(PAYLOAD)) is None
    assert format_.verify_file(renamed, len(PAYLOAD)) == "another key"
    assert format_.verify_file(tmp_path / f"not-a-key{CHUNK_SUFFIX}", 4096) == (
        "file name is not a key"
    )
    assert format_.verify_file(tmp_path / chunk_name(keys("gone", 1)[0]), 4096) == (
        "unreadable: No such file or directory"
    )


# ------------------------------------------------------------------ names


def test_a_chunk_is_named_by_its_key_and_the_name_gives_the_key_back():
    for key in keys("names", 4, group=3):
        name = chunk_name(key)
        assert name == f"{key.hex()}.kvt"
        assert chunk_path(key) == f"{key.hex()[:2]}/{name}"
        assert key_of(name) == key


@pytest.mark.parametrize(
    "name", [NAMESPACE_FILE, "zz.kvt", "abc.kvt", ".kvt.tmp", "ab.kvt.1.ff.tmp", "ab.kvtx", ""]
)
def test_a_name_that_is_not_a_chunk_gives_no_key(name):
    assert key_of(name) is None


def test_a_forked_writer_names_its_temporary_files_apart_from_its_parent():
    parent = temp_name("x.kvt")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the same serial numbers would follow, not the same tag
        os.write(write, temp_name("x.kvt").encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 4096).decode()
    os.close(read)
    assert child.split(".")[2:4] != parent.split(".")[2:4]
    assert child.split(".")[2] == str(pid)


def test_temporary_names_are_unique_and_never_taken_for_chunks():
    names = {temp_name(chunk_name(KEY)) for _ in range(100)}
    assert len(names) == 100
    for name in names:
        assert name.startswith(f"{chunk_name(KEY)}.{os.getpid()}.")
        assert name.endswith(TEMP_SUFFIX)
        assert key_of(name) is None


def test_the_namespace_directory_shows_the_model_and_keeps_namespaces_apart():
    mine, other = ChunkFormat(NAMESPACE), ChunkFormat(NAMESPACE + "x")
    directory = namespace_directory("org/Model-7B", mine)
    assert directory == f"org_Model-7B_{hashlib.sha256(NAMESPACE.encode()).hexdigest()[:32]}"
    assert namespace_directory("org/Model-7B", other) != directory


@pytest.mark.parametrize(
    ("model", "slug"),
    [("", "model"), ("///", "model"), ("a b:c", "a_b_c"), ("x" * 100, "x" * 64)],
)
def test_a_model_name_becomes_a_safe_directory_name(model, slug):
    assert model_slug(model) == slug


# ------------------------------------------------------- namespace.json


def test_a_namespace_description_reads_back_what_it_wrote():
    description = NamespaceDescription(NAMESPACE, 4096, "org/Model")
    text = description.to_json()
    assert json.loads(text) == {
        "kvtier_chunk_format": 1,
        "namespace": NAMESPACE,
        "chunk_bytes": 4096,
        "model": "org/Model",
    }
    assert NamespaceDescription.from_json(text) == description


def test_a_namespace_description_of_the_wrong_shape_reads_as_nothing():
    assert NamespaceDescription.from_json("[1, 2]") is None
    odd = NamespaceDescription.from_json('{"namespace": 7, "chunk_bytes": true, "model": null}')
    assert odd == NamespaceDescription(None, None, None)
    with pytest.raises(ValueError):
        NamespaceDescription.from_json("{not json")


# ------------------------------------------- an outside tool and the fs tier

BLOCK = 16 * 1024  # bytes per GPU block; one block per chunk, so one slot's row


def fs_config(engine_id: str, root: Path):
    tiers = [{"type": "fs", "root_dir": str(root)}]
    return tiering_config(engine_id, tiers, chunks=4, kv_bytes_per_block=BLOCK, model_name="m")


def kv_tensor(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 255, (16, BLOCK), dtype=torch.uint8, generator=gen)


def read_chunks(root: Path) -> dict[OffloadKey, bytes]:
    """Every sound chunk under an fs tier's ``root_dir``, as a tool that knows only
    kvtier.format reads them."""
    found = {}
    for description_file in root.glob(f"*/{NAMESPACE_FILE}"):
        description = NamespaceDescription.from_json(description_file.read_text())
        assert description is not None and description.namespace is not None
        assert description.chunk_bytes is not None
        chunk_format = ChunkFormat(description.namespace)
        for path in description_file.parent.glob(f"*/*{CHUNK_SUFFIX}"):
            assert chunk_format.verify_file(path, description.chunk_bytes) is None, path
            key = key_of(path.name)
            assert key is not None
            found[key] = path.read_bytes()[HEADER_BYTES:]
    return found


@pytest.mark.anyio
async def test_an_outside_tool_reads_the_chunks_an_fs_tier_wrote(engine_id, tmp_path):
    kv_cache = kv_tensor(1)
    ks = keys("outside-read", 6)
    async with KVTier(fs_config(engine_id, tmp_path), [kv_cache]) as kv:
        await store_all(kv, ks)
        assert kv.manager.tiers[0].ctx.namespace.startswith("kvtier/v1;model=m;")
    chunks = read_chunks(tmp_path)
    assert sorted(chunks) == sorted(ks)
    for block, key in enumerate(ks):
        assert chunks[key] == kv_cache[block].numpy().tobytes()


@pytest.mark.anyio
async def test_an_fs_tier_serves_a_chunk_an_outside_tool_wrote(engine_id, tmp_path):
    kv_cache = kv_tensor(2)
    async with KVTier(fs_config(engine_id, tmp_path), [kv_cache]) as kv:
        [description_file] = tmp_path.glob(f"*/{NAMESPACE_FILE}")
        description = NamespaceDescription.from_json(description_file.read_text())
        assert description is not None and description.namespace is not None
        chunk_format = ChunkFormat(description.namespace)
        directory = tmp_path / namespace_directory(description.model or "", chunk_format)
        assert directory == description_file.parent
        [key] = keys("outside-write", 1)
        payload = bytes(range(256)) * (BLOCK // 256)
        path = directory / chunk_path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(temp_name(path.name))
        tmp.write_bytes(bytes(chunk_format.header(key, memoryview(payload))) + payload)
        tmp.rename(path)
        assert await kv.lookup([key], "reader", timeout=30) == 1
        assert await kv.load([key], [9], "reader") == 1
        assert kv_cache[9].numpy().tobytes() == payload
