"""kvtier inspect's reading of an fs tier's root_dir, laid out through kvtier.format."""

from __future__ import annotations

from pathlib import Path

from helpers import keys

from kvtier.cache_inspect import inspect_root
from kvtier.format import (
    HEADER_BYTES,
    NAMESPACE_FILE,
    ChunkFormat,
    NamespaceDescription,
    chunk_path,
    namespace_directory,
    temp_name,
)
from kvtier.keys import OffloadKey

NAMESPACE = "kvtier/v1;model=m;dtype=bf16;tokens=16;world=1;column=4096;chunk=4096"


def write_chunk(directory: Path, chunk_format: ChunkFormat, key: OffloadKey, row: bytes) -> None:
    path = directory / chunk_path(key)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(bytes(chunk_format.header(key, memoryview(row))) + row)
    assert len(path.read_bytes()) == HEADER_BYTES + len(row)


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
