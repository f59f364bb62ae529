"""benchmarks/real_model.py, shrunk to a few requests (``nox -s model``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.model, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "real_model.py"


def test_the_real_model_benchmark_reports_every_mode_and_equal_continuations(tmp_path):
    out = tmp_path / "report.json"
    command = [sys.executable, str(SCRIPT), "--users", "2", "--turns", "1"]
    command += ["--system-tokens", "256", "--new-tokens", "4", "--primary-tokens", "1024"]
    command += ["--concurrent-requests", "3", "--concurrent-rules", "10"]
    command += ["--concurrent-tokens", "4", "--root", str(tmp_path), "--json", str(out)]
    subprocess.run(command, check=True, capture_output=True, timeout=800)
    report = json.loads(out.read_text())
    assert set(report["ttft_ms"]) >= {
        "no_cache",
        "primary",
        "fs",
        "slow_tier",
        "fast_tier",
        "in_process",
    }
    # A link faster than recomputing is used; each request's prefill is observed.
    assert report["degraded_tiers"]["fast_tier"]["hits"] > 0
    assert report["recompute_ms_per_chunk"] > 0
    for figures in report["ttft_ms"].values():
        assert 0 < figures["p50"] <= figures["p99"]
    assert report["continuations_equal"] is True
    assert report["shared_prefix_tokens"] >= 256
    assert 0 < report["kvtier_share"] < 1
    assert report["speedup_fs"] > 0
    # Sent at once with a new system prompt, the first computes it, the others reuse it.
    concurrent = report["concurrent"]
    assert concurrent["requests_reusing_the_prompt"] >= 2
    assert concurrent["answers_equal"] is True
