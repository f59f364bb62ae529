"""benchmarks/vllm_path.py, run briefly: its JSON and its integrity.

In this process rather than as a script: importing vLLM again would take longer than
the run itself.
"""

from __future__ import annotations

import json

import pytest
import vllm_path

#: The figures set beside serving_path.py's, and the ones only this benchmark has.
REQUIRED = {
    "promotion_gbps",
    "promotion_ratio",
    "raw_read_gbps",
    "promotion_p50_ms",
    "promotion_p99_ms",
    "request_wait_p50_ms",
    "request_wait_p99_ms",
    "loop_lag_p99_ms",
    "load_cpu_s",
    "cpu_s_per_gib",
    "step_p50_ms",
    "step_p99_ms",
    "connector_own_ms_per_step",
    "adapter_own_ms_per_step",
    "kvtier_own_ms_per_step",
    "mismatches",
    "recomputed_blocks",
}


@pytest.mark.slow
def test_a_quick_vllm_path_run_verifies_every_block_and_reports_every_figure(
    model_config, tmp_path, capsys
):
    # model_config: vLLM's architecture probe has run once in this session's cache.
    vllm_path.main(["--quick", "--root", str(tmp_path)])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert REQUIRED - figures.keys() == set()
    assert figures["mismatches"] == 0
    # Every prompt came back whole from kvtier, all of it read from the fs tier.
    assert figures["recomputed_blocks"] == 0
    assert figures["fs_bytes_read"] == figures["chunks"] * figures["chunk_bytes"]
    assert figures["promotion_jobs"] == figures["chunks"] // figures["job_chunks"]
    assert 0 < figures["kvtier_own_ms_per_step"] < figures["step_ms_mean"]
    assert list(tmp_path.iterdir()) == []  # the run cleans up after itself


@pytest.mark.slow
def test_a_quick_run_of_a_hybrid_model_at_tp_2_verifies_every_block_of_both_ranks(
    model_config, tmp_path, capsys
):
    vllm_path.main(["--quick", "--root", str(tmp_path), "--groups", "2", "--tp", "2"])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (figures["groups"], figures["tp"]) == (2, 2)
    assert figures["mismatches"] == 0
    assert figures["recomputed_blocks"] == 0
    # The window group's chunks come back from the fs tier beside the full group's.
    assert figures["fs_bytes_read"] > figures["chunks"] * figures["chunk_bytes"]
    assert list(tmp_path.iterdir()) == []


def test_a_chunk_size_that_no_kv_geometry_fits_is_refused_with_the_flag_named(capsys):
    with pytest.raises(SystemExit) as exit_:
        vllm_path.parse_args(["--chunk-mib", "0.001"])
    assert exit_.value.code == 2
    assert "--chunk-mib must be a multiple of" in capsys.readouterr().err
