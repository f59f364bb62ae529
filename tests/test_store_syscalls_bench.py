"""benchmarks/store_syscalls.py, run as a user runs it where vLLM is not installed:
kvtier's calls measured, vLLM's C writer named as not measured, bad input refused."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers import run_benchmark


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return run_benchmark("store_syscalls.py", *args, timeout=100)


@pytest.mark.slow
def test_without_vllm_a_quick_run_measures_kvtier_s_calls_and_says_what_it_left_out(tmp_path):
    done = run_script("--quick", "--threads", "2", "--root", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report["figures"]) == {"python", "python+checksum"}
    for way in report["figures"].values():
        (cell,) = way.values()
        assert cell["gbps"] > 0 and cell["cpu_s_per_gib"] > 0
    assert report["not_measured"]["vllm_c"].startswith("not measured: vLLM does not import")
    assert "vllm_c: not measured" in done.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--threads", "1,many"], "--threads: 'many' is not a thread count (1 or more)"),
        (["--threads", "0"], "--threads: '0' is not a thread count (1 or more)"),
        (["--runs", "0"], "--gib 1.0 and --runs 0: both must be above 0"),
        (["--chunk-mib", "0.001"], "--chunk-mib: 0.001 MiB is not a whole number of pages"),
    ],
)
def test_bad_arguments_are_refused_by_name(args, message):
    done = run_script(*args)
    assert done.returncode == 2
    assert message in done.stderr
