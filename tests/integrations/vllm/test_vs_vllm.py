"""benchmarks/vs_vllm.py, run briefly: both sides' figures, their integrity, vLLM's I/O path.

In this process rather than as a script: importing vLLM again would take longer than
the run itself.
"""

from __future__ import annotations

import json

import pytest
import vs_vllm

#: The figures each side reports (as ``vllm_<name>`` and ``kvtier_<name>``).
REQUIRED = {
    "store_gbps",
    "promotion_gbps",
    "request_wait_p50_ms",
    "request_wait_p99_ms",
    "request_ready_p50_ms",
    "request_ready_p99_ms",
    "lookup_hit_ops_s",
    "store_cycle_ops_s",
    "store_cpu_s_per_gib",
    "load_cpu_s_per_gib",
    "mismatches",
}


@pytest.mark.slow
def test_a_quick_run_reports_both_sides_whole_and_the_io_path_vllm_took(tmp_path, capsys):
    root, out = tmp_path / "root", tmp_path / "report.json"
    root.mkdir()
    # On a busy host: threads of the process run Python beside either side.
    vs_vllm.main(["--quick", "--root", str(root), "--json", str(out), "--busy-host", "0.3"])
    figures = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    chunks, job_chunks = figures["chunks"], figures["job_chunks"]
    for side in ("vllm", "kvtier"):
        assert {f"{side}_{name}" for name in REQUIRED} - figures.keys() == set()
        assert figures[f"{side}_mismatches"] == 0
        (run,) = figures[f"{side}_runs"]
        assert run["busy_share_store"] > 0 and run["busy_share_load"] > 0
        # Every chunk reached the disk as a file of its own and came back from it.
        assert run["files_on_disk"] == chunks
        assert run["promoted_bytes"] == chunks * figures["chunk_bytes"]
        assert run["requests_loaded"] == chunks // job_chunks
        assert run["copy_failures"] == 0
        # A request is ready once its copy is done, after its chunks became readable.
        assert run["request_ready_p50_ms"] >= run["request_wait_p50_ms"] > 0
        # The raw read of the files the run promoted from, right after it.
        assert run["own_files_read_gbps"] > 0
        assert figures[f"{side}_promotion_own_ratio"] > 0
    # kvtier over vLLM for each figure (a count of 0 has no ratio).
    assert {f"ratio_{name}" for name in REQUIRED - {"mismatches"}} - figures.keys() == set()
    assert "kvtier_loop_lag_p99_ms" in figures
    # kvtier's CPU per GiB stored is held to vLLM's plus its checksum pass alone.
    assert figures["checksum_cpu_s_per_gib"] > 0
    assert figures["store_cpu_s_per_gib_allowed"] == pytest.approx(
        figures["vllm_store_cpu_s_per_gib"] + figures["checksum_cpu_s_per_gib"], abs=1e-3
    )
    assert figures["page_cache"] == "fadvise"  # --quick leaves the page cache alone
    # vLLM's fs tier took its C extension exactly when the extension could be loaded.
    in_c = figures["vllm_io_path"] == "C extension (vllm.fs_io_C)"
    assert in_c == figures["fs_io_extension"].startswith("loaded"), figures["fs_io_extension"]
    assert in_c or figures["vllm_io_path"] == "pure Python"
    # Every run's files stayed until the end (a temporary directory has the room), and
    # the end removed them all.
    assert figures["files_kept"] is True
    assert list(root.iterdir()) == []  # the run cleans up after itself


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data-gib", "0.03", "--primary-gib", "0.016"], "less than one request"),
        (["--primary-gib", "0.25"], "--primary-gib must hold --in-flight requests"),
        (["--chunk-mib", "0.001"], "whole number of 4 KiB pages"),
        (["--busy-host", "1.5", "--busy-threads", "1"], "--busy-host must be between 0"),
    ],
)
def test_sizes_that_cannot_run_are_refused_with_the_flag_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        vs_vllm.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
