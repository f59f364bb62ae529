"""The raw references benchmarks hold the tiers against."""

from __future__ import annotations

import pytest

from kvtier.bench import physical
from kvtier.bench.physical import measure_disk, measure_reads


def test_a_raw_read_of_existing_files_reads_them_whole_at_each_depth(tmp_path):
    # Files of uneven sizes, as tiers write them (a header page and a chunk): the
    # figure is their bytes over the best pass's time, so it is positive and finite.
    paths = []
    for i, size in enumerate([4096 + 65536, 4096 + 65536, 12345]):
        path = tmp_path / f"{i:02x}" / "chunk.bin"
        path.parent.mkdir()
        path.write_bytes(bytes([i]) * size)
        paths.append(path)
    gbps = measure_reads(paths, depths=(2, 4))
    assert 0 < gbps < float("inf")
    # Reading leaves the files as they were.
    assert [path.read_bytes()[:1] for path in paths] == [b"\x00", b"\x01", b"\x02"]


def test_a_raw_read_of_no_file_is_refused():
    with pytest.raises(ValueError, match="at least one file"):
        measure_reads([])


@pytest.mark.parametrize("keep", [False, True])
def test_a_raw_disk_pass_removes_its_files_unless_asked_to_keep_them(tmp_path, keep):
    # Kept, every pass's files stay for the caller to remove once nothing is measured:
    # removals between passes would slow the next pass's file creations.
    limits = measure_disk(tmp_path / "raw", 6, 65536, depths=(2,), keep=keep)
    assert limits.write_gbps > 0 and limits.read_gbps > 0
    left = sorted(path for path in (tmp_path / "raw").rglob("*.raw"))
    if keep:
        assert {path.parent.parent.name for path in left} == {"raw-1", "raw-2"}
        assert len(left) == 12
        assert all(path.stat().st_size == 4096 + 65536 for path in left)
    else:
        assert left == []


def test_the_checksum_pass_costs_cpu_in_proportion_to_the_bytes():
    # A small span and total keep it quick; the figure is CPU seconds per GiB.
    per_gib = physical.measure_checksum(1 << 20, nbytes=64 << 20, span=16 << 20)
    assert 0 < per_gib < 10
