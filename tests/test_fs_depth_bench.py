"""benchmarks/fs_depth.py, run briefly as a user runs it: adaptive and fixed depths
stored through the fs tier after files were removed nearby, and the figures it gives."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers import run_benchmark


def run_script(*args: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    return run_benchmark("fs_depth.py", *args, timeout=timeout)


@pytest.mark.slow
def test_a_quick_run_stores_at_each_depth_and_sets_the_adaptive_one_against_the_best(tmp_path):
    done = run_script("--quick", "--root", str(tmp_path), "--cpu-burners", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(figures["gbps"]) == {"auto", "4"}
    assert all(value > 0 for value in figures["gbps"].values())
    assert figures["best_fixed"] == "4"
    assert figures["adaptive_over_best"] == pytest.approx(
        figures["gbps"]["auto"] / figures["gbps"]["4"], rel=1e-3
    )
    # The adaptive run's depth was sampled, starting where the fs tier starts.
    (trace,) = figures["traces"]
    assert trace and trace[0] >= 1
    assert figures["removals"] == figures["chunks"] > 0
    assert list(tmp_path.iterdir()) == []  # the run cleans up after itself


def test_a_depth_that_is_neither_auto_nor_a_number_is_refused_by_name():
    done = run_script("--depths", "auto,deep")
    assert done.returncode == 2
    assert "--depths: 'deep' is neither auto nor a depth" in done.stderr
