"""benchmarks/store_syscalls.py, run briefly: vLLM's C writer and kvtier's system calls
on the same chunks, every way at every thread count, and the directory left clean."""

from __future__ import annotations

import json
from pathlib import Path

import store_syscalls

WAYS = {"vllm_c", "python", "python+checksum"}


def shared_memory_files() -> set[str]:
    return {path.name for path in Path("/dev/shm").glob("kvtier_bench-syscalls-*")}


def test_a_quick_run_measures_each_way_at_each_thread_count(tmp_path, capsys):
    before = shared_memory_files()
    out = tmp_path / "report.json"
    assert store_syscalls.main(["--quick", "--root", str(tmp_path), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    # vLLM's C extension loaded here (the session installs vLLM), so nothing is missing.
    assert report["not_measured"] == {}
    assert set(report["figures"]) == WAYS
    for way in WAYS:
        assert set(report["figures"][way]) == {"1", "4"}
        for cell in report["figures"][way].values():
            assert cell["gbps"] > 0
            assert cell["cpu_s_per_gib"] > 0
            assert min(cell["user_s_per_gib"], cell["sys_s_per_gib"]) >= 0
    assert report["checksum_cpu_s_per_gib"] > 0
    assert report["region_checksum_cpu_s_per_gib"] > 0
    assert report["chunks"] * report["chunk_bytes"] == 1 << 25
    # Every pass's files and the region are gone.
    assert list(tmp_path.iterdir()) == [out]
    assert shared_memory_files() == before
