"""The bench report: promotion percentiles taken from measured job times, footnotes
that say what the tables print, and a plot that tells idle from stalled."""

from __future__ import annotations

import json
import re

import pytest
from helpers import scripted
from kvtier_cli import SMALL_BENCH, kvtier
from scripted_tier import ScriptedTier

from kvtier.bench.replay import TimelinePoint
from kvtier.bench.report import draw, quiet_spans
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


# ------------------------------------------------ footnotes true to the printed figures


def bench_tables(tmp_path, *extra: str) -> tuple[str, dict]:
    """``kvtier bench`` run as a user runs it: its tables (stdout) and its JSON report."""
    out = tmp_path / "report.json"
    result = kvtier("bench", *SMALL_BENCH, "--quiet", "--json", str(out), *extra)
    assert result.returncode == 0, result.stderr
    return " ".join(result.stdout.split()), json.loads(out.read_text())


def row(text: str, label: str) -> list[str]:
    """The cells of the table row ``label``, as printed."""
    found = re.search(rf"│ {re.escape(label)} +│([^\n]*?)│ (?:│|└|[a-z])", text)
    assert found, label
    return [cell.strip() for cell in found.group(1).split("│")]


@pytest.mark.parametrize("workload", ["multi-round-qa", "cold-warm"])
def test_the_limits_footnote_names_the_ratios_the_table_prints(tmp_path, workload):
    text, report = bench_tables(tmp_path, "--workload", workload)
    ratios = report["ratios"]
    write, read = f"{ratios['fs_write']:.2f}", f"{ratios['fs_read']:.2f}"
    assert row(text, "disk write (raw pwritev)")[-1] == write
    assert row(text, "disk read (raw preadv)")[-1] == read
    here = f"(here disk write (raw pwritev) {write}, disk read (raw preadv) {read})"
    assert here in text
    if workload == "cold-warm":
        assert "cold-warm drives the tiers flat out" in text
    else:
        assert f"{workload} moves data only when its requests need it" in text
        assert "cold-warm drives the tiers flat out" not in text


def test_the_tiers_footnote_counts_what_the_table_counts(tmp_path):
    text, report = bench_tables(tmp_path, "--workload", "multi-round-qa")
    primary = report["tiers"][0]
    chunks = report["requests"]["chunks"]
    # The primary tier's lookups beyond the chunks requested are said only when seen.
    said = f"0:primary counts {primary['queries']:,} for {chunks:,} chunks requested"
    assert (said in text) == (primary["queries"] > chunks)
    assert row(text, "hits left to recompute") == ["0", "0"]
    assert "hits left to recompute: secondary hits not promoted" in text
    assert "none here, as no recompute_s_per_chunk is set" in text


def test_the_tiers_footnote_counts_the_hits_left_to_recompute(tmp_path):
    config = tmp_path / "extra.json"
    # Recomputing a chunk "costs" a nanosecond: every hit after the fs tier's first
    # promotion would arrive later, and is a miss.
    config.write_text(json.dumps({"recompute_s_per_chunk": 1e-9}))
    text, report = bench_tables(tmp_path, "--workload", "cold-warm", "--config", str(config))
    skipped = report["tiers"][1]["skipped_slower_than_recompute"]
    assert skipped > 0
    assert row(text, "hits left to recompute") == ["0", f"{skipped:,}"]
    assert (
        f"hits left to recompute: {skipped:,} secondary hits were misses because their "
        "promotion would have arrived later than recomputing the chunk "
        "(recompute_s_per_chunk 1e-09 s)"
    ) in text


# ------------------------------------------------------- the plot's quiet spans


def point(t: float, requests: int, in_flight: int) -> TimelinePoint:
    return {
        "t": t,
        "requests": requests,
        "in_flight": in_flight,
        "chunks": 0,
        "hits": 0,
        "tiers": {},
    }


def test_spans_without_a_finished_request_are_idle_or_stalled_by_what_was_in_flight():
    timeline = [
        point(0.0, 0, 2),
        point(0.5, 3, 2),  # requests finish
        point(1.0, 3, 2),  # none finish, two in flight: stalled
        point(1.5, 3, 1),  # still none: the stall goes on
        point(2.0, 5, 0),  # they finish
        point(2.5, 5, 0),  # nothing in flight, nothing finished: idle
        point(3.0, 5, 2),  # started, not finished: stalled from the idle moment on
        point(3.5, 6, 1),
    ]
    assert quiet_spans(timeline) == [
        (0.5, 1.5, "stalled"),
        (2.0, 2.5, "idle"),
        (2.5, 3.0, "stalled"),
    ]
    assert quiet_spans(timeline[:2]) == []


def test_the_plot_shades_a_stall_where_requests_wait_on_a_slow_tier(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = tmp_path / "extra.json"
    # Every promotion takes 0.8 s: the read-back wave's requests wait longer than a
    # sampling interval with none finishing.
    tier = scripted("bench-stalled", instant=True, load_delay_s=0.8)
    config.write_text(json.dumps({"secondary_tiers": [tier]}))
    out = tmp_path / "report.json"
    argv = ["bench", *SMALL, "--workload", "cold-warm", "--config", str(config)]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    stalls = [span for span in quiet_spans(report["timeline"]) if span[2] == "stalled"]
    assert stalls and max(end - start for start, end, _ in stalls) >= 0.5
    figure, _ = draw([report])
    try:
        hit_axis, rate_axis = figure.axes[0], figure.axes[1]
        legend = [t.get_text() for t in hit_axis.get_legend().get_texts()]
        assert "stalled: requests in flight, none finished" in legend
        for axis in (hit_axis, rate_axis):
            shaded = [(patch.get_x(), patch.get_x() + patch.get_width()) for patch in axis.patches]
            assert all(any(a <= start and end <= b for a, b in shaded) for start, end, _ in stalls)
    finally:
        plt.close(figure)
