"""``benchmarks/sglang_backend.py`` runs (briefly) and finds every page it stored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[3] / "benchmarks" / "sglang_backend.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_backend_benchmark_runs_and_loads_every_page_byte_exact(tmp_path):
    # Its own process: the benchmark publishes SGLang settings of its own.
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=280,
        env=os.environ.copy(),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    for backend in ("kvtier", "file"):
        for phase in ("stored", "load_cold", "load_warm"):
            assert figures[f"{backend}_{phase}_wrong_pages"] == 0
            assert figures[f"{backend}_{phase}_missing_pages"] == 0
            assert figures[f"{backend}_{phase}_pages_per_s"] > 0
    assert list(tmp_path.iterdir()) == []  # its directories are removed
