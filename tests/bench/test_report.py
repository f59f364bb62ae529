"""The bench report's promotion percentiles: taken from measured job times."""

from __future__ import annotations

import json

from helpers import scripted
from scripted_tier import ScriptedTier

from kvtier.cli import main

SMALL = [
    "--chunk-mib", "0.25", "--primary-mib", "16", "--working-set-mib", "48",
    "--max-prompt-chunks", "16", "--concurrency", "2", "--quiet",
]  # fmt: skip


def test_promotion_percentiles_come_from_every_measured_job(tmp_path):
    delay_s = 0.03
    config = tmp_path / "extra.json"
    tier = scripted("bench-delayed", instant=True, load_delay_s=delay_s)
    config.write_text(json.dumps({"secondary_tiers": [tier]}))
    out = tmp_path / "report.json"
    argv = ["bench", *SMALL, "--workload", "cold-warm", "--config", str(config)]
    assert main([*argv, "--json", str(out)]) == 0
    entry = json.loads(out.read_text())["tiers"][1]
    jobs = ScriptedTier.instances["bench-delayed"].load_jobs
    # One measured time per promotion job the tier ran, not a count of histogram buckets...
    assert entry["promotion_jobs"] == len(jobs) > 0
    promotion = entry["promotion_ms"]
    # ...and each of them at least the tier's own delay.
    assert promotion["p99"] >= promotion["p50"] >= delay_s * 1e3
