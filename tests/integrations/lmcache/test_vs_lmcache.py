"""benchmarks/vs_lmcache.py, run briefly: every side's figures, and its byte check.

In this process rather than as a script, as tests/integrations/vllm/test_vs_vllm.py runs
vs_vllm.py.
"""

from __future__ import annotations

import json

import pytest
import vs_lmcache

pytestmark = [pytest.mark.lmcache, pytest.mark.slow]

LINES = ("1MiB_odirect", "1MiB_pagecache")


def quick_run(tmp_path, capsys, *extra: str) -> dict:
    root, out = tmp_path / "root", tmp_path / "report.json"
    root.mkdir()
    vs_lmcache.main(["--quick", "--root", str(root), "--json", str(out), *extra])
    figures = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    # Each run's directory went with its line, and the run's own with the run.
    assert list(root.iterdir()) == []
    return figures


def test_a_quick_run_gives_every_side_every_figure_and_no_mismatch(tmp_path, capsys):
    figures = quick_run(tmp_path, capsys)
    for line in LINES:
        for side in vs_lmcache.SIDES:
            for name in vs_lmcache.FIGURES:
                assert figures[f"{line}_{side}_{name}"] > 0, f"{line}_{side}_{name}"
            assert figures[f"{line}_{side}_mismatches"] == 0
        assert figures[f"{line}_kvtier_integrity_failures"] == 0
        assert {f"{line}_ratio_{name}" for name in vs_lmcache.FIGURES} <= figures.keys()
    # The page-cache line is that on every side; the O_DIRECT one is LMCache's as asked
    # and kvtier's as its defaults found the filesystem (a temporary directory on disk).
    for side in vs_lmcache.SIDES:
        assert figures[f"1MiB_pagecache_{side}_o_direct"] is False
    for side in vs_lmcache.LMCACHE_SIDES:
        assert figures[f"1MiB_odirect_{side}_o_direct"] is True
    assert isinstance(figures["kvtier_ahead"], bool)
    assert figures["kvtier_ahead"] == (figures["kvtier_behind"] == [])


def test_a_corrupted_file_is_a_mismatch_on_every_side(tmp_path, capsys):
    # One flipped byte in one stored file per side and line: LMCache's adapters serve
    # it (their files have no checksum) and the harness's byte check counts it; kvtier's
    # tier refuses it (an integrity failure, the object not loaded), counted as well.
    figures = quick_run(tmp_path, capsys, "--corrupt", "1")
    for line in LINES:
        for side in vs_lmcache.SIDES:
            assert figures[f"{line}_{side}_mismatches"] == 1, f"{line}_{side}"
        assert figures[f"{line}_kvtier_integrity_failures"] == 1


class Swapped:
    """The stored bytes with the objects of each pair swapped."""

    def __init__(self, payloads: vs_lmcache.Payloads) -> None:
        self.payloads = payloads

    def __getitem__(self, index: int):
        return self.payloads[index ^ 1]


@pytest.mark.parametrize("side_name", vs_lmcache.SIDES)
def test_bytes_other_than_those_stored_are_counted_object_by_object(tmp_path, side_name):
    stored, other = vs_lmcache.Payloads(4096, 4, seed=0), vs_lmcache.Payloads(4096, 4, seed=1)
    assert len({bytes(stored[i]) for i in range(4)}) == 4  # every object its own bytes
    side = vs_lmcache.open_side(side_name, tmp_path / "side", 4096, 2, odirect=False)
    try:
        side.store_batch(0, stored)
        side.store_batch(1, stored)
        assert side.load_batch(0, stored)[2] == 0
        assert side.load_batch(1, other)[2] == 2
        # Each object checked against its neighbour's bytes, as if the two files were
        # swapped: both count.
        assert side.load_batch(0, Swapped(stored))[2] == 2
    finally:
        side.close()
