"""kvtier bench and kvtier inspect: arguments, the JSON report, every workload, briefly."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from kvtier_cli import SMALL_BENCH, kvtier

from kvtier.bench.report import draw, plot
from kvtier.bench.workloads import WORKLOADS
from kvtier.cli import main

SMALL = [
    "--chunk-mib", "0.25", "--primary-mib", "16", "--working-set-mib", "48",
    "--max-prompt-chunks", "16", "--concurrency", "2", "--quiet",
]  # fmt: skip


def run_bench(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "report.json"
    assert main(["bench", *SMALL, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def check_schema(report: dict) -> None:
    assert isinstance(report["workload"], str)
    assert {"p50", "p99"} <= set(report["loop_lag_ms"])
    assert {"disk_write_gbps", "disk_read_gbps"} <= set(report["physical"])
    assert {"fs_write", "fs_read"} <= set(report["ratios"])
    names = [tier["name"] for tier in report["tiers"]]
    assert names == ["0:primary", "1:fs"]
    for tier in report["tiers"]:
        assert {
            "name", "queries", "hits", "hit_rate", "bytes_written", "bytes_read",
            "write_gbps", "read_gbps",
        } <= set(tier)  # fmt: skip
        assert 0.0 <= tier["hit_rate"] <= 1.0


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_every_workload_runs_briefly_and_serves_no_wrong_bytes(tmp_path, workload):
    report = run_bench(tmp_path, "--workload", workload)
    check_schema(report)
    assert report["workload"] == workload
    assert report["requests"]["count"] > 0
    assert report["requests"]["wrong_chunks"] == 0
    assert all(tier["integrity_failures"] == 0 for tier in report["tiers"])


def test_reuse_workloads_hit_and_the_no_reuse_one_does_not(tmp_path):
    reuse = run_bench(tmp_path, "--workload", "long-doc-qa")
    fresh = run_bench(tmp_path, "--workload", "no-reuse")
    assert reuse["requests"]["chunk_hit_rate"] > 0.3
    assert fresh["requests"]["chunk_hit_rate"] == 0.0


def test_cold_warm_reads_everything_back_from_the_fs_tier(tmp_path):
    report = run_bench(tmp_path, "--workload", "cold-warm")
    fs = report["tiers"][1]
    assert fs["bytes_read"] >= fs["bytes_written"] * 0.9
    assert report["ratios"]["fs_read"] > 0


def test_all_workloads_give_one_combined_report(tmp_path):
    report = run_bench(tmp_path, "--workload", "all", "--duration", "20")
    check_schema(report)
    assert report["workload"] == "all"
    assert [run["workload"] for run in report["runs"]] == list(WORKLOADS)


def test_extra_config_from_a_file_reaches_the_engine(tmp_path):
    config = tmp_path / "extra.json"
    config.write_text(json.dumps({"eviction_policy": "arc"}))
    report = run_bench(tmp_path, "--config", str(config), "--workload", "shared-prefix")
    check_schema(report)


def test_s3_and_p2p_tiers_bring_their_own_server_and_peer(tmp_path):
    report = run_bench(tmp_path, "--workload", "cold-warm", "--tiers", "p2p,s3")
    assert report["requests"]["wrong_chunks"] == 0
    _, p2p, s3 = report["tiers"]
    assert (p2p["name"], s3["name"]) == ("1:p2p", "2:s3")
    # The spawned peer computed the workload's latest chunks: the cold pass finds
    # them there; the warm pass reads the rest back from the S3 server.
    assert p2p["hits"] > 0 and p2p["bytes_read"] > 0
    assert s3["bytes_written"] > 0 and s3["bytes_read"] > 0
    assert all(tier["integrity_failures"] == 0 for tier in report["tiers"])
    assert {"s3_put_gbps", "s3_get_gbps", "tcp_loopback_gbps"} <= set(report["physical"])
    assert report["ratios"]["s3_read"] > 0 and report["ratios"]["p2p_read"] > 0


def test_a_primary_tier_smaller_than_the_requests_in_flight_is_warned_about(tmp_path, capsys):
    run_bench(tmp_path, "--workload", "no-reuse", "--primary-mib", "4")
    err = capsys.readouterr().err
    assert "kvtier: warning: --primary-mib 4 is below what the requests in flight" in err
    run_bench(tmp_path, "--workload", "no-reuse")
    assert "warning" not in capsys.readouterr().err


def test_a_secondary_tiers_list_in_the_config_replaces_the_tiers_option(tmp_path):
    mine = tmp_path / "mine"
    config = tmp_path / "extra.json"
    config.write_text(json.dumps({"secondary_tiers": [{"type": "fs", "root_dir": str(mine)}]}))
    report = run_bench(
        tmp_path, "--config", str(config), "--tiers", "p2p", "--workload", "no-reuse"
    )
    assert [tier["name"] for tier in report["tiers"]] == ["0:primary", "1:fs"]
    assert report["settings"]["tiers"] == ["fs"]
    assert report["tiers"][1]["bytes_written"] > 0
    assert any(mine.rglob("*.kvt"))


def test_a_bad_extra_config_value_is_reported_by_its_key(tmp_path, capsys):
    config = tmp_path / "extra.json"
    config.write_text(json.dumps({"eviction_policy": "mru"}))
    with pytest.raises(SystemExit) as info:
        main(["bench", *SMALL, "--config", str(config)])
    assert info.value.code == 2
    assert "eviction_policy: unknown eviction policy 'mru'" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_get_it(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(SystemExit) as info:
        main(["bench", *SMALL, "--plot", "out.png"])
    assert info.value.code == 2
    assert "pip install '.[plot]' in kvtier's checkout" in capsys.readouterr().err


def test_plot_draws_hit_rate_and_throughput_over_time(tmp_path):
    report = run_bench(tmp_path, "--workload", "multi-round-qa")
    picture = tmp_path / "bench.png"
    assert plot([report], picture) >= 2 * (len(report["timeline"]) - 1) > 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run_bench(tmp_path, "--workload", "no-reuse", "--plot", str(picture))  # from the command
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_shows_the_secondary_tiers_and_both_hit_rates_legends_beside_the_data(
    tmp_path,
):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = run_bench(tmp_path, "--workload", "cold-warm")
    figure, points = draw([report])
    try:
        labels = {axis.get_title(): axis for axis in figure.axes}
        hit_axis = labels["cold-warm: chunk hit rate"]
        rate_axis = next(axis for title, axis in labels.items() if "throughput" in title)
        legend = [t.get_text() for t in hit_axis.get_legend().get_texts()]
        assert legend[:2] == ["per 0.5 s interval", "since the start"]
        # Then one entry for each kind of span shaded (none, in a run without pauses).
        assert set(legend[2:]) <= {
            "idle: no request in flight", "stalled: requests in flight, none finished",
        }  # fmt: skip
        # No flat line for the primary tier, whose bytes are the engine's; a line for
        # each disk limit the run measured, at its figure.
        physical = report["physical"]
        assert [t.get_text() for t in rate_axis.get_legend().get_texts()] == [
            "1:fs in", "1:fs out",
            f"disk write (raw pwritev) {physical['disk_write_gbps']:g}",
            f"disk read (raw preadv) {physical['disk_read_gbps']:g}",
        ]  # fmt: skip
        limits = [line for line in rate_axis.get_lines() if line.get_label().startswith("disk")]
        assert [line.get_ydata()[0] for line in limits] == [
            physical["disk_write_gbps"], physical["disk_read_gbps"],
        ]  # fmt: skip
        figure.canvas.draw()
        for axis in (hit_axis, rate_axis):
            legend = axis.get_legend().get_window_extent()
            assert legend.x0 >= axis.get_window_extent().x1  # beside the data, not over it
        assert points > 0
    finally:
        plt.close(figure)


def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        time.sleep(0.05)  # not listening yet
        return ""


def test_metrics_are_served_on_loopback_while_the_bench_runs(tmp_path):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result: dict[str, int] = {}
    runner = threading.Thread(
        target=lambda: result.update(code=main(["bench", *SMALL, "--metrics-port", str(port)]))
    )
    runner.start()
    body = ""
    deadline = time.monotonic() + 60
    while runner.is_alive() and time.monotonic() < deadline and "kvtier_tiering" not in body:
        body = scrape(f"http://127.0.0.1:{port}/metrics")
    runner.join(120)
    assert result.get("code") == 0
    assert "kvtier_tiering_chunk_queries_total" in body


def test_inspect_lists_and_verifies_an_fs_root(tmp_path, capsys):
    root = tmp_path / "cache"
    run_bench(tmp_path, "--workload", "no-reuse", "--root", str(root))
    # The raw disk passes kept their files until the last one ended, then all went.
    assert not (root / "physical").exists()
    capsys.readouterr()
    assert main(["inspect", str(root / "fs"), "--json"]) == 0
    [counted] = json.loads(capsys.readouterr().out)
    assert counted["chunks"] > 0
    assert counted["verified"] is None and counted["bad"] is None  # nothing was checked
    assert main(["inspect", str(root / "fs"), "--verify", "--json"]) == 0
    [namespace] = json.loads(capsys.readouterr().out)
    assert namespace["chunks"] > 0
    assert namespace["verified"] == namespace["chunks"] and namespace["bad"] == {}
    victim = next((root / "fs").rglob("*.kvt"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main(["inspect", str(root / "fs"), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "payload checksum mismatch" in out and "1 bad" in out


# --------------------------------------------------- the working directory (--root)


def test_a_second_run_in_one_root_is_refused_unless_asked_to_reuse_it(tmp_path):
    root = tmp_path / "root"
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    args = ["bench", *SMALL_BENCH, "--workload", "no-reuse", "--root", str(root)]
    assert kvtier(*args, "--json", str(first)).returncode == 0
    refused = kvtier(*args)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert f"--root {root} is not empty" in refused.stderr and "--reuse-root" in refused.stderr
    reused = kvtier(*args, "--reuse-root", "--json", str(second))
    assert reused.returncode == 0, reused.stderr
    # The same prompts again, from the first run's cache: what reuse is for.
    assert json.loads(first.read_text())["requests"]["chunk_hit_rate"] == 0.0
    assert json.loads(second.read_text())["requests"]["chunk_hit_rate"] > 0.5


def test_a_root_whose_parent_is_missing_is_refused_and_nothing_created(tmp_path):
    root = tmp_path / "missing" / "deep" / "root"
    result = kvtier("bench", *SMALL_BENCH, "--root", str(root))
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert f"{root.parent} does not exist" in result.stderr
    assert not (tmp_path / "missing").exists()


def test_an_fs_tier_whose_root_dir_parent_is_missing_is_refused_by_its_key(tmp_path):
    config = tmp_path / "extra.json"
    missing = tmp_path / "missing" / "cache"
    config.write_text(json.dumps({"secondary_tiers": [{"type": "fs", "root_dir": str(missing)}]}))
    result = kvtier("bench", *SMALL_BENCH, "--config", str(config))
    assert result.returncode == 2
    assert f"kvtier: error: secondary_tiers[0].root_dir: {missing.parent} does not exist" in (
        result.stderr
    )
    assert not missing.parent.exists()


# ------------------------------------------------------------ a tier that fails

BROKEN_TIER = '''
from kvtier import SecondaryTier


class UnreachableTier(SecondaryTier):
    """Every call fails, as a tier behind a refused connection does."""

    async def lookup(self, keys):
        raise ConnectionRefusedError(111, "Connection refused (127.0.0.1:9)")

    async def store(self, job):
        raise ConnectionRefusedError(111, "Connection refused (127.0.0.1:9)")

    async def load(self, job):
        raise ConnectionRefusedError(111, "Connection refused (127.0.0.1:9)")
'''


def test_a_run_whose_tier_failed_everything_exits_1_saying_why_in_one_line(tmp_path):
    (tmp_path / "unreachable_tier.py").write_text(BROKEN_TIER)
    config = tmp_path / "extra.json"
    tier = {"type": "UnreachableTier", "module_path": "unreachable_tier"}
    config.write_text(json.dumps({"secondary_tiers": [tier]}))
    out = tmp_path / "report.json"
    result = kvtier(
        "bench", *SMALL_BENCH, "--workload", "no-reuse", "--config", str(config),
        "--json", str(out), env={"PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("kvtier: error:")]
    assert line.startswith("kvtier: error: tier 1:UnreachableTier failed every lookup ("), line
    assert "and every cascade (" in line and "ConnectionRefusedError" in line
    report = json.loads(out.read_text())
    assert report["errors"] == [line.removeprefix("kvtier: error: ")]
    broken = report["tiers"][1]
    # A request counts a chunk's answer once, and no further than its first miss; the
    # tier's failed batches count every chunk they asked for, ahead of the requests.
    assert broken["hits"] == 0 and broken["lookup_failures"] >= broken["queries"] > 0
    assert broken["cascade_failures"] > 0 and broken["bytes_written"] == 0


def test_a_run_whose_tiers_all_answered_reports_no_errors(tmp_path):
    report = run_bench(tmp_path, "--workload", "no-reuse")
    assert report["errors"] == [] and report["warnings"] == []
    assert report["tiers"][1]["lookup_failures"] == report["tiers"][1]["cascade_failures"] == 0


def test_an_s3_endpoint_nobody_listens_on_stops_the_run_before_it_starts(tmp_path):
    import socket

    with socket.socket() as probe:  # a loopback port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "extra.json"
    tier = {
        "type": "s3", "bucket": "kv-cache", "endpoint_url": f"http://127.0.0.1:{port}",
        "access_key_id": "key", "secret_access_key": "secret", "retry_attempts": 0,
    }  # fmt: skip
    config.write_text(json.dumps({"secondary_tiers": [tier]}))
    result = kvtier("bench", *SMALL_BENCH, "--config", str(config))
    assert result.returncode == 2
    [line] = [line for line in result.stderr.splitlines() if line.startswith("kvtier: error:")]
    assert f"tier 1:s3: cannot reach bucket 'kv-cache' at http://127.0.0.1:{port}" in line


# ------------------------------------------------ where the output goes, and its width


def test_reports_go_to_stdout_and_progress_to_stderr_a_line_per_phase(tmp_path):
    result = kvtier("bench", *SMALL_BENCH, "--workload", "no-reuse", env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("no-reuse: ")
    assert "kvtier bench:" not in result.stdout
    phases = [line for line in result.stderr.splitlines() if line.startswith("kvtier bench:")]
    assert re.fullmatch(r"kvtier bench: no-reuse: starting the fs tier \[\d+ s\]", phases[0])
    assert re.fullmatch(r"kvtier bench: no-reuse: replaying \d+ requests \[\d+ s\]", phases[1])
    assert any("requests served" in line for line in phases)
    # The limits phase shows each limit, and each pass of the raw disk's, as it starts.
    limits = [line for line in phases if "measuring the physical limits" in line]
    assert phases[-1 - len(limits) : -1] == limits
    assert limits[0].startswith("kvtier bench: no-reuse: measuring the physical limits: memcpy [")
    assert limits[1].startswith(
        "kvtier bench: no-reuse: measuring the physical limits: fs (disk write (raw pwritev), "
        "disk read (raw preadv)) ["
    )
    passes = [
        re.fullmatch(r".*: fs, pass (\d) of (\d), (\d+) threads?: (writing|reading) .*", line)
        for line in limits[2:]
    ]
    assert all(passes), limits[2:]
    steps = [(int(m[1]), int(m[2]), m[4]) for m in passes if m]
    count = steps[0][1]
    assert count >= 2  # one thread, and the fs tier's own depths
    assert steps == [
        (n, count, step) for n in range(1, count + 1) for step in ("writing", "reading")
    ]
    assert phases[-1].startswith("kvtier bench: no-reuse: done (the replay took ")
    assert not any(mark in result.stderr for mark in "┃│━")  # no table, no bar


def test_the_tables_fit_80_columns_without_cutting_a_cell_short(tmp_path):
    out = tmp_path / "report.json"
    result = kvtier(
        "bench", *SMALL_BENCH, "--workload", "cold-warm", "--quiet", "--json", str(out),
        env={"COLUMNS": "80"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    assert "…" not in result.stdout
    report = json.loads(out.read_text())
    header = next(line for line in lines if "0:primary" in line)
    assert [cell.strip() for cell in header.split("┃")[1:-1]] == ["", "0:primary", "1:fs"]
    lookups = next(line for line in lines if line.startswith("│ lookups "))
    assert [cell.strip() for cell in lookups.split("│")[2:4]] == [
        f"{tier['queries']:,}" for tier in report["tiers"]
    ]
    # Without a GPU, CPU tensors hold the KV cache, and the rows say so.
    kv = "GPU" if report["settings"]["device"] == "cuda" else "CPU"
    assert f"│ load (primary -> KV on {kv})" in result.stdout
    text = " ".join(lines)
    assert "GB/s: the bytes over the span from the tier's first transfer to its last" in text
    assert "kvtier / limit: the tier's GB/s over the raw figure measured in this run" in text


def test_inspect_of_a_bench_root_or_a_namespace_directory_says_where_to_look(tmp_path):
    root = tmp_path / "cache"
    ran = kvtier("bench", *SMALL_BENCH, "--workload", "no-reuse", "--quiet", "--root", str(root))
    assert ran.returncode == 0, ran.stderr
    at_root = kvtier("inspect", str(root))
    # No cache right there: an error a script sees, with the way to the cache in it.
    assert at_root.returncode == 2 and at_root.stdout == ""
    assert at_root.stderr.startswith(f"kvtier: error: {root}: no kvtier cache")
    assert f"kvtier inspect {root / 'fs'}" in at_root.stderr
    [namespace_dir] = [p for p in (root / "fs").iterdir() if p.is_dir()]
    inside = kvtier("inspect", str(namespace_dir), "--json")
    assert inside.returncode == 2 and inside.stdout == ""
    assert "is a namespace directory itself" in inside.stderr
    assert f"kvtier inspect {root / 'fs'}" in inside.stderr
    assert kvtier("inspect", str(root / "fs")).returncode == 0


# --------------------------------------- where the run writes, checked before it starts


def unwritable_directory(tmp_path: Path) -> Path:
    """A directory in which this user can create nothing.

    Permission bits do for a user other than root; root ignores them, so for root it is
    /sys, where even root creates nothing (skipped where that is not so).
    """
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        return locked
    try:
        Path(tempfile.mkdtemp(dir="/sys")).rmdir()
    except OSError:
        return Path("/sys")
    pytest.skip("no directory here that root cannot write")


def refused_before_the_run(result, *fragments: str) -> None:
    """One error line naming the location, exit code 2, and no run begun."""
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr  # no progress line: nothing ran
    assert result.stderr.startswith("kvtier: error: ")
    for fragment in fragments:
        assert fragment in result.stderr


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_an_output_file_under_a_regular_file_is_refused_before_the_run(tmp_path, option):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    target = a_file / "out.png"
    result = kvtier("bench", *SMALL_BENCH, option, str(target))
    refused_before_the_run(result, f"{option} {target}: {a_file} is not a directory")


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_an_output_file_in_a_directory_nobody_can_write_is_refused_before_the_run(tmp_path, option):
    target = unwritable_directory(tmp_path) / "out.png"
    result = kvtier("bench", *SMALL_BENCH, option, str(target))
    refused_before_the_run(result, f"{option} {target}: cannot create it in {target.parent}: ")


def test_an_output_file_that_is_a_directory_is_refused_before_the_run(tmp_path):
    result = kvtier("bench", *SMALL_BENCH, "--json", str(tmp_path))
    refused_before_the_run(result, f"--json {tmp_path}: is a directory")


def test_a_plot_in_a_format_matplotlib_cannot_write_is_refused_before_the_run(tmp_path):
    target = tmp_path / "bench.txt"
    result = kvtier("bench", *SMALL_BENCH, "--plot", str(target))
    refused_before_the_run(result, f"--plot {target}: matplotlib cannot write .txt files", ".png")


def test_a_root_under_a_regular_file_is_refused_before_the_run(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    root = a_file / "root"
    result = kvtier("bench", *SMALL_BENCH, "--root", str(root))
    refused_before_the_run(result, f"--root {root}: {a_file} is not a directory")


def test_a_root_that_cannot_be_created_is_refused_before_the_run(tmp_path):
    root = unwritable_directory(tmp_path) / "kvtier-bench-root"
    result = kvtier("bench", *SMALL_BENCH, "--root", str(root))
    refused_before_the_run(result, f"--root {root}: cannot create it in {root.parent}: ")
    assert not root.exists()


def test_a_primary_tier_dev_shm_cannot_hold_is_refused_naming_primary_mib():
    stat = os.statvfs("/dev/shm")
    too_big = stat.f_bavail * stat.f_frsize // (1 << 20) + 1024
    result = kvtier("bench", "--primary-mib", str(too_big))
    refused_before_the_run(
        result, f"kvtier: error: --primary-mib {too_big}: /dev/shm has ", "lower --primary-mib"
    )
    assert "cpu_bytes_to_use" not in result.stderr


def test_hits_slower_than_recomputing_are_skipped_and_reported(tmp_path):
    config = tmp_path / "extra.json"
    # Recomputing a chunk "costs" a nanosecond: once the fs tier has finished a
    # promotion, every later hit there would arrive later, and is a miss.
    config.write_text(json.dumps({"recompute_s_per_chunk": 1e-9}))
    report = run_bench(tmp_path, "--config", str(config), "--workload", "cold-warm")
    fs = report["tiers"][1]
    assert fs["skipped_slower_than_recompute"] > 0
    assert report["requests"]["wrong_chunks"] == 0
    plain = run_bench(tmp_path, "--workload", "cold-warm")
    assert plain["tiers"][1]["skipped_slower_than_recompute"] == 0
