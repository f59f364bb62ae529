"""benchmarks/serving_path.py, run briefly as a user runs it: its JSON and its integrity."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers import run_benchmark

#: The figures the serving-path issue asks for, by name.
REQUIRED = {
    "promotion_gbps",
    "promotion_ratio",
    "store_gbps",
    "store_ratio",
    "promotion_p50_ms",
    "promotion_p99_ms",
    "promotion_p99_budget_ms",
    "loop_lag_p99_ms",
    "lookup_hit_ops_s",
    "store_cycle_ops_s",
    "mismatches",
}


def run_script(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run_benchmark("serving_path.py", *args, timeout=timeout)


@pytest.mark.slow
def test_a_quick_serving_path_run_reports_every_figure_and_no_mismatch(tmp_path):
    # On a busy host: threads of its own run Python beside the tiers all along.
    done = run_script("--quick", "--root", str(tmp_path), "--busy-host", "0.3", timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert REQUIRED - figures.keys() == set()
    assert figures["busy_share_store"] > 0 and figures["busy_share_load"] > 0
    assert figures["mismatches"] == 0
    # Everything stored went to the fs tier and came back from it.
    assert figures["fs_bytes_read"] == figures["chunks"] * figures["chunk_bytes"]
    assert figures["promotion_jobs"] == figures["chunks"] // figures["job_chunks"]
    assert list(tmp_path.iterdir()) == []  # the run cleans up after itself


def test_bad_sizes_are_refused_with_the_flag_named():
    done = run_script("--in-flight", "0")
    assert done.returncode == 2
    assert "--in-flight must be at least 1" in done.stderr


def test_an_unknown_tier_option_is_named_without_a_traceback(tmp_path):
    done = run_script("--quick", "--root", str(tmp_path), "--tier-option", "x=1")
    assert done.returncode == 1
    assert "secondary_tiers[0].x: unknown setting" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_busy_host_beyond_its_threads_is_refused_with_the_flag_named():
    done = run_script("--busy-host", "3", "--busy-threads", "2")
    assert done.returncode == 2
    assert "--busy-host must be between 0 and --busy-threads" in done.stderr
