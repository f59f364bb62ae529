"""The stored-chunk layout the fs and s3 tiers share with kvtier inspect, and the
path of a chunk that fails verification."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers import keys

from kvtier._logs import ThrottledLog
from kvtier.cache_inspect import inspect_root
from kvtier.keys import OffloadKey
from kvtier.tiers._format import HEADER_BYTES, ChunkFormat
from kvtier.tiers._store import (
    NAMESPACE_FILE,
    TEMP_SUFFIX,
    CorruptChunks,
    NamespaceDescription,
    chunk_name,
    chunk_path,
    key_of,
    model_slug,
    namespace_directory,
    temp_name,
)
from kvtier.tiers.base import TierContext

pytestmark = pytest.mark.anyio

NAMESPACE = "kvtier/v1;model=m;dtype=bf16;tokens=16;world=1;column=4096;chunk=4096"
logger = logging.getLogger("kvtier.tests.store")


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


def test_temporary_names_are_unique_and_never_taken_for_chunks():
    [key] = keys("temp", 1)
    names = {temp_name(chunk_name(key)) for _ in range(100)}
    assert len(names) == 100
    for name in names:
        assert name.startswith(chunk_name(key)) and name.endswith(TEMP_SUFFIX)
        assert key_of(name) is None


def test_the_namespace_directory_shows_the_model_and_keeps_namespaces_apart():
    mine, other = ChunkFormat(NAMESPACE), ChunkFormat(NAMESPACE + "x")
    directory = namespace_directory("org/Model-7B", mine)
    assert directory == f"org_Model-7B_{mine.digest_hex}"
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
    odd = NamespaceDescription.from_json('{"namespace": 7, "chunk_bytes": "big", "model": null}')
    assert odd == NamespaceDescription(None, None, None)
    with pytest.raises(ValueError):
        NamespaceDescription.from_json("{not json")


def test_inspect_reads_the_layout_the_tiers_write(tmp_path):
    chunk_format = ChunkFormat(NAMESPACE)
    directory = tmp_path / namespace_directory("m", chunk_format)
    directory.mkdir()
    (directory / NAMESPACE_FILE).write_text(NamespaceDescription(NAMESPACE, 4096, "m").to_json())
    good, bad = keys("inspect", 2)
    for key in (good, bad):
        write_chunk(directory, chunk_format, key, bytes(range(256)) * 16)
    path = directory / chunk_path(bad)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    (directory / "ab").mkdir()
    (directory / "ab" / "not-a-key.kvt").write_bytes(b"x")
    (directory / "ab" / temp_name("abcd.kvt")).write_bytes(b"torn")
    [report] = inspect_root(tmp_path, verify=True)
    assert report.directory == directory.name
    assert (report.namespace, report.model, report.chunk_bytes) == (NAMESPACE, "m", 4096)
    assert (report.chunks, report.verified, report.temporary_files) == (3, 1, 1)
    assert report.bad == {
        str(path.relative_to(tmp_path)): "payload checksum mismatch",
        f"{directory.name}/ab/not-a-key.kvt": "file name is not a key",
    }


def write_chunk(directory: Path, chunk_format: ChunkFormat, key: OffloadKey, row: bytes) -> None:
    path = directory / chunk_path(key)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(bytes(chunk_format.header(key, memoryview(row))) + row)
    assert len(path.read_bytes()) == HEADER_BYTES + len(row)


# -------------------------------------------------------- corrupt chunks


class Removals:
    """A remover that records what it was asked to remove and removes ``keep`` not."""

    def __init__(self, keep: set[OffloadKey] | None = None) -> None:
        self.asked: list[list[OffloadKey]] = []
        self.keep = keep or set()

    async def __call__(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        self.asked.append(list(keys))
        return [key for key in keys if key not in self.keep]


def corrupt_chunks() -> tuple[CorruptChunks, TierContext]:
    # No slot is read or written: the context only counts.
    ctx = TierContext(primary_view=None, chunk_bytes=4096, namespace=NAMESPACE, tier_name="1:fs")
    log = ThrottledLog(logger, "tier 1:fs", interval_s=3600)
    return CorruptChunks(ctx, log, lambda key: f"/cache/{chunk_name(key)}"), ctx


async def test_corrupt_chunks_are_counted_removed_and_reported_in_one_line(caplog):
    caplog.set_level(logging.WARNING, logger=logger.name)
    chunks, ctx = corrupt_chunks()
    first, second = keys("corrupt", 2)
    remove = Removals()
    problems = {first: "payload checksum mismatch", second: "truncated file"}
    assert await chunks.discard(problems, "promotion job 7", remove) == [first, second]
    assert ctx.counters.integrity_failures == 2
    assert remove.asked == [[first, second]]
    assert [r.getMessage() for r in caplog.records] == [
        "tier 1:fs: 2 stored chunk(s) failed verification during promotion job 7 "
        f"(payload checksum mismatch, truncated file), e.g. /cache/{chunk_name(first)}; "
        "2 removed, never served"
    ]


async def test_corrupt_chunks_found_again_soon_are_counted_but_not_logged_again(caplog):
    caplog.set_level(logging.WARNING, logger=logger.name)
    chunks, ctx = corrupt_chunks()
    for i, key in enumerate(keys("again", 3)):
        await chunks.discard({key: "foreign namespace"}, f"promotion job {i}", Removals())
    assert ctx.counters.integrity_failures == 3
    assert len(caplog.records) == 1


async def test_a_chunk_that_could_not_be_removed_still_counts(caplog):
    caplog.set_level(logging.WARNING, logger=logger.name)
    chunks, ctx = corrupt_chunks()
    [key] = keys("stuck", 1)
    assert await chunks.discard({key: "another key"}, "a lookup", Removals(keep={key})) == []
    assert ctx.counters.integrity_failures == 1
    assert "0 removed, never served" in caplog.records[0].getMessage()


async def test_nothing_corrupt_counts_removes_and_logs_nothing(caplog):
    caplog.set_level(logging.WARNING, logger=logger.name)
    chunks, ctx = corrupt_chunks()
    remove = Removals()
    assert await chunks.discard({}, "a lookup", remove) == []
    assert (ctx.counters.integrity_failures, remove.asked, caplog.records) == (0, [], [])
