"""A bench report: built from a replay as JSON for tools, shown as tables for people,
combined over several runs, plotted on request."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.table import Table

from kvtier.bench.probe import percentile
from kvtier.bench.registry import MEMCPY_KEY, BenchTierRegistry, Direction, Limit
from kvtier.bench.replay import SAMPLE_INTERVAL_S, Replay, TimelinePoint
from kvtier.bench.settings import BenchSettings
from kvtier.bench.tiers import BENCH_TIERS
from kvtier.bench.workloads import Workload

__all__ = [
    "PRIMARY",
    "build_report",
    "combine",
    "draw",
    "limits_note",
    "plot",
    "print_report",
    "quiet_spans",
    "tier_problems",
    "tiers_note",
]

GB = 1e9
MIB = 1 << 20
#: The primary tier's label; the secondary tiers' are "<position>:<name>".
PRIMARY = "0:primary"


def build_report(
    settings: BenchSettings,
    workload: Workload,
    run: Replay,
    counts: Mapping[str, Mapping[str, float]],
    labels: Sequence[str],
    promotions: Mapping[str, Sequence[float]],
    device: str,
) -> dict[str, Any]:
    """The report of one replay (see ``kvtier bench --json``), before its limits.

    ``counts`` are the manager's cumulative counts by tier label, ``labels`` the tiers
    in lookup order (the primary tier first), ``promotions`` the measured promotion job
    latencies in seconds by tier label (``manager.diagnostics.promotion_latencies()``).
    """
    requests = run.requests
    return {
        "workload": workload.name,
        "description": workload.description,
        "settings": {
            "chunk_bytes": settings.chunk_bytes,
            "primary_bytes": settings.primary_bytes,
            "working_set_bytes": workload.unique_chunks * settings.chunk_bytes,
            "concurrency": settings.concurrency,
            "tiers": [label.split(":", 1)[1] for label in labels[1:]],
            "device": device,
        },
        "requests": {
            "count": requests.requests,
            "chunks": requests.chunks,
            "chunk_hit_rate": requests.hits / requests.chunks if requests.chunks else 0.0,
            "wrong_chunks": requests.wrong_chunks,
            "lookup_ms": _percentiles(requests.lookup_s),
            "load_ms": _percentiles(requests.load_s),
            "store_ms": _percentiles(requests.store_s),
        },
        "tiers": [
            _tier_entry(label, counts.get(label, {}), settings, run, promotions.get(label, ()))
            for label in labels
        ],
        "loop_lag_ms": _percentiles(run.loop_lags),
        "timeline": run.timeline,
    }


def _tier_entry(
    label: str,
    counts: Mapping[str, float],
    settings: BenchSettings,
    run: Replay,
    promotions: Sequence[float],
) -> dict[str, Any]:
    queries, hits = counts.get("queries", 0.0), counts.get("hits", 0.0)
    written: float
    read: float
    write_gbps: float | None
    read_gbps: float | None
    promotion: tuple[float | None, float | None]
    if label == PRIMARY:
        # The primary tier's bytes are the engine's: what it stored and loaded.
        written = run.requests.stored * settings.chunk_bytes
        read = run.requests.hits * settings.chunk_bytes
        write_gbps = read_gbps = None
        promotion = (None, None)
    else:
        written, read = counts.get("bytes_written", 0.0), counts.get("bytes_read", 0.0)
        write_gbps = _active_gbps(run.timeline, label, "bytes_written")
        read_gbps = _active_gbps(run.timeline, label, "bytes_read")
        # Percentiles of measured job times: histogram buckets would only give edges.
        if promotions:
            promotion = (percentile(promotions, 0.5), percentile(promotions, 0.99))
        else:
            promotion = (None, None)
    return {
        "name": label,
        "queries": int(queries),
        "hits": int(hits),
        "hit_rate": hits / queries if queries else 0.0,
        "bytes_written": int(written),
        "bytes_read": int(read),
        "write_gbps": write_gbps,
        "read_gbps": read_gbps,
        "promotion_ms": {"p50": _ms(promotion[0]), "p99": _ms(promotion[1])},
        "promotion_jobs": len(promotions),
        "stores_dropped": int(counts.get("stores_dropped", 0.0)),
        "integrity_failures": int(counts.get("integrity_failures", 0.0)),
        "lookup_failures": int(counts.get("lookup_failures", 0.0)),
        "cascade_failures": int(counts.get("cascade_failures", 0.0)),
        "promotion_failures": int(counts.get("promotion_failures", 0.0)),
        "skipped_slower_than_recompute": int(counts.get("skipped_slower_than_recompute", 0.0)),
    }


def tier_problems(
    tiers: Sequence[Mapping[str, Any]], reasons: Mapping[str, str]
) -> tuple[list[str], list[str]]:
    """``(errors, warnings)``: one line per tier that failed everything, or some things.

    A tier fails the run when every lookup it was asked failed, or every cascade or
    promotion it ran failed: its figures then measure nothing. ``reasons`` hold the
    first problem each tier logged, by label.
    """
    errors: list[str] = []
    warnings: list[str] = []
    for tier in tiers:
        label = tier["name"]
        total: list[str] = []
        partial: list[str] = []
        lookups, failed = tier["queries"], tier["lookup_failures"]
        if failed >= lookups and failed:
            total.append(f"every lookup ({failed:,} chunks)")
        elif failed:
            partial.append(f"{failed:,} of {lookups:,} chunk lookups")
        for kind, moved in (("cascade", "bytes_written"), ("promotion", "bytes_read")):
            jobs = tier[f"{kind}_failures"]
            if jobs and tier[moved]:
                partial.append(f"{jobs:,} {kind}s")
            elif jobs:
                total.append(f"every {kind} ({jobs:,} jobs)")
        reason = reasons.get(label)
        because = f": {reason}" if reason else ""
        if total:
            errors.append(f"tier {label} failed {' and '.join(total + partial)}{because}")
        elif partial:
            warnings.append(f"tier {label} failed {' and '.join(partial)}{because}")
    return errors, warnings


def _active_gbps(
    timeline: Sequence[TimelinePoint],
    label: str,
    field_name: Literal["bytes_written", "bytes_read"],
) -> float:
    """Bytes over the time the counter was rising (first to last increase)."""
    points = [
        (p["t"], p["tiers"][label][field_name] if label in p["tiers"] else 0.0) for p in timeline
    ]
    rising = [i for i in range(1, len(points)) if points[i][1] > points[i - 1][1]]
    if not rising:
        return 0.0
    start, end = points[rising[0] - 1][0], points[rising[-1]][0]
    moved = points[rising[-1]][1] - points[rising[0] - 1][1]
    return moved / max(end - start, 1e-9) / 1e9


def _percentiles(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(values, 0.5) * 1e3, 3),
        "p99": round(percentile(values, 0.99) * 1e3, 3),
    }


def _ms(seconds: float | None) -> float | None:
    if seconds is None:
        return None
    return round(seconds * 1e3, 3)


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(
    report: dict[str, Any], console: Console, bench_tiers: BenchTierRegistry = BENCH_TIERS
) -> None:
    """The tables of one run; ``bench_tiers`` give the rows of the limits table.

    The tiers are columns and the figures rows, so that the tables fit 80 columns with
    four tiers; a cell too wide for the console folds onto a second line rather than
    being cut short.
    """
    settings = report["settings"]
    requests = report["requests"]
    console.print(
        f"[bold]{report['workload']}[/bold]: {report['description']}\n"
        f"{requests['count']:,} requests, {requests['chunks']:,} chunks requested, "
        f"chunk hit rate {requests['chunk_hit_rate']:.1%}, {report['duration_s']:.1f} s "
        f"({settings['device']}, {settings['chunk_bytes'] / MIB:g} MiB chunks, "
        f"primary {settings['primary_bytes'] >> 20} MiB, working set "
        f"{settings['working_set_bytes'] >> 20} MiB)"
    )
    tiers = report["tiers"]
    table = _table("tiers", [tier["name"] for tier in tiers])
    for label, cell in _TIER_ROWS:
        table.add_row(label, *(cell(tier) for tier in tiers))
    console.print(table)
    console.print(tiers_note(report), style="dim", highlight=False)
    # The KV tensors live on the GPU, or on the CPU standing in for one.
    kv = "GPU" if settings["device"] == "cuda" else "CPU"
    latency = _table("latency per request (ms) and event loop", ["p50", "p99"])
    for name, key in (
        ("lookup to ready", "lookup_ms"),
        (f"load (primary -> KV on {kv})", "load_ms"),
        (f"store (KV on {kv} -> primary)", "store_ms"),
    ):
        latency.add_row(name, _num(requests[key]["p50"], 1), _num(requests[key]["p99"], 1))
    lag = report["loop_lag_ms"]
    latency.add_row("event-loop lag", _num(lag["p50"]), _num(lag["p99"]))
    console.print(latency)
    physical = report.get("physical", {})
    ratios = report.get("ratios", {})
    notes = report.get("ratio_notes", {})
    limits = _table("physical limits measured in this run", ["GB/s", "kvtier / limit"])
    if MEMCPY_KEY in physical:
        limits.add_row("memcpy", _num(physical[MEMCPY_KEY]), "")
    shown = [limit for limit in bench_tiers.limits() if limit.key in physical]
    for limit in shown:
        ratio = _num(ratios.get(limit.ratio))
        # A ratio above 1 is marked, its reason printed right under the table.
        marked = f"{ratio} *" if limit.ratio in notes else ratio
        limits.add_row(limit.label, _num(physical[limit.key]), marked)
    console.print(limits)
    for limit in shown:
        if limit.ratio in notes:
            console.print(
                f"* {limit.label}: kvtier / limit {ratios[limit.ratio]:.2f}, above 1 because "
                f"{notes[limit.ratio]}",
                highlight=False,
            )
    console.print(limits_note(report, shown), style="dim", highlight=False)
    if requests["wrong_chunks"]:
        console.print(
            f"[bold red]{requests['wrong_chunks']} chunks were served with wrong bytes[/]"
        )


def tiers_note(report: Mapping[str, Any]) -> str:
    """The footnote of the tiers table: what its rows count, said of this run's figures."""
    requests = report["requests"]
    primary = report["tiers"][0]
    lines = ["lookups: each time a tier was asked about a chunk."]
    if primary["queries"] > requests["chunks"]:
        lines.append(
            f"{primary['name']} counts {primary['queries']:,} for {requests['chunks']:,} "
            "chunks requested: a request waiting for a promotion asks it again."
        )
    lines.append(
        "GB/s: the bytes over the span from the tier's first transfer to its last, the "
        "pauses between included."
    )
    recompute_s = report["settings"].get("recompute_s_per_chunk")
    if recompute_s is None:
        lines.append(
            "hits left to recompute: secondary hits not promoted because recomputing the "
            "chunk would be sooner; none here, as no recompute_s_per_chunk is set."
        )
    else:
        skipped = sum(tier["skipped_slower_than_recompute"] for tier in report["tiers"])
        lines.append(
            f"hits left to recompute: {skipped:,} secondary hits were misses because their "
            f"promotion would have arrived later than recomputing the chunk "
            f"(recompute_s_per_chunk {recompute_s:g} s)."
        )
    return " ".join(lines)


def limits_note(report: Mapping[str, Any], shown: Sequence[Limit]) -> str:
    """The footnote of the limits table, naming the ratios it explains: a serving
    workload's are a floor on how busy the tier was, cold-warm's how close it came to
    the hardware."""
    ratios = report.get("ratios", {})
    notes = report.get("ratio_notes", {})
    listed = [
        f"{limit.label} {ratios[limit.ratio]:.2f}"
        for limit in shown
        if ratios.get(limit.ratio) is not None and limit.ratio not in notes
    ]
    text = "kvtier / limit: the tier's GB/s over the raw figure measured in this run."
    if not listed:
        return f"{text} - where the tier moved nothing that way."
    here = f"here {', '.join(listed)}"
    if report["workload"] == "cold-warm":
        return (
            f"{text} cold-warm drives the tiers flat out (every chunk stored once, then "
            f"read back from below), so its ratios ({here}) measure how close kvtier comes "
            "to the hardware."
        )
    return (
        f"{text} {report['workload']} moves data only when its requests need it, and a "
        "tier's GB/s count the pauses between, so a ratio is the share of that time the "
        f"raw I/O would take to move the same bytes ({here}), not how fast the tier can "
        "go: --workload cold-warm measures that."
    )


def _table(title: str, columns: Sequence[str]) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("", justify="left", overflow="fold")
    for column in columns:
        table.add_column(column, justify="right", overflow="fold")
    return table


def _count(key: str) -> Callable[[Mapping[str, Any]], str]:
    return lambda tier: f"{tier[key]:,}"


def _gb(key: str) -> Callable[[Mapping[str, Any]], str]:
    return lambda tier: _num(tier[key] / GB)


def _gbps(key: str) -> Callable[[Mapping[str, Any]], str]:
    return lambda tier: _num(tier[key])


def _promotion(tier: Mapping[str, Any]) -> str:
    promotion = tier["promotion_ms"]
    return f"{_num(promotion['p50'], 1)} / {_num(promotion['p99'], 1)}"


def _failed_jobs(tier: Mapping[str, Any]) -> str:
    return f"{tier['cascade_failures']:,} / {tier['promotion_failures']:,}"


#: The rows of the tiers table: a label, and the cell of one tier's entry.
_TIER_ROWS: tuple[tuple[str, Callable[[Mapping[str, Any]], str]], ...] = (
    ("lookups", _count("queries")),
    ("hits", _count("hits")),
    ("hit rate", lambda tier: f"{tier['hit_rate']:.1%}"),
    ("failed lookups", _count("lookup_failures")),
    ("GB stored into it", _gb("bytes_written")),
    ("GB read back from it", _gb("bytes_read")),
    ("GB/s storing", _gbps("write_gbps")),
    ("GB/s reading back", _gbps("read_gbps")),
    ("promotion ms p50 / p99", _promotion),
    ("failed cascades / promotions", _failed_jobs),
    ("cascades dropped", _count("stores_dropped")),
    ("hits left to recompute", _count("skipped_slower_than_recompute")),
    ("corrupt chunks discarded", _count("integrity_failures")),
)


#: The per-tier counts :func:`combine` adds up over runs.
_SUMMED = (
    "queries",
    "hits",
    "bytes_written",
    "bytes_read",
    "stores_dropped",
    "integrity_failures",
    "lookup_failures",
    "cascade_failures",
    "promotion_failures",
    "skipped_slower_than_recompute",
)


def combine(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One object for several runs: per-run reports, totals per tier, the worst lag."""
    tiers: dict[str, dict[str, Any]] = {}
    for report in reports:
        for tier in report["tiers"]:
            total = tiers.setdefault(
                tier["name"],
                {"name": tier["name"], **dict.fromkeys(_SUMMED, 0), "_w": 0.0, "_r": 0.0},
            )
            for field in _SUMMED:
                total[field] += tier[field]
            # Bytes-weighted means of the runs' rates.
            total["_w"] += (tier["write_gbps"] or 0.0) * tier["bytes_written"]
            total["_r"] += (tier["read_gbps"] or 0.0) * tier["bytes_read"]
    for total in tiers.values():
        total["hit_rate"] = total["hits"] / total["queries"] if total["queries"] else 0.0
        weighted_w, weighted_r = total.pop("_w"), total.pop("_r")
        total["write_gbps"] = weighted_w / total["bytes_written"] if weighted_w else None
        total["read_gbps"] = weighted_r / total["bytes_read"] if weighted_r else None
    bandwidth = next((r for r in reports if r["workload"] == "cold-warm"), reports[-1])
    return {
        "workload": "all",
        "tiers": list(tiers.values()),
        "loop_lag_ms": {
            "p50": max(r["loop_lag_ms"]["p50"] for r in reports),
            "p99": max(r["loop_lag_ms"]["p99"] for r in reports),
        },
        "physical": bandwidth.get("physical", {}),
        "ratios": bandwidth.get("ratios", {}),
        "ratio_notes": bandwidth.get("ratio_notes", {}),
        "errors": [f"{r['workload']}: {line}" for r in reports for line in r.get("errors", [])],
        "warnings": [f"{r['workload']}: {line}" for r in reports for line in r.get("warnings", [])],
        "runs": list(reports),
    }


def plot(reports: Sequence[dict[str, Any]], path: Path) -> int:
    """Draw hit rate and each tier's throughput over time (needs matplotlib).

    Returns how many points were drawn: none when a run was shorter than two samples.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, points = draw(reports)
    # "tight" keeps the legends, drawn beside the axes, inside the picture.
    figure.savefig(path, bbox_inches="tight")
    plt.close(figure)
    return points


#: A span of the timeline in which no request finished: why.
SpanKind = Literal["idle", "stalled"]

#: How each kind of span is drawn: its legend entry and its colour.
_SPANS: dict[SpanKind, tuple[str, str]] = {
    "idle": ("idle: no request in flight", "0.85"),
    "stalled": ("stalled: requests in flight, none finished", "tab:red"),
}


def quiet_spans(timeline: Sequence[TimelinePoint]) -> list[tuple[float, float, SpanKind]]:
    """The spans ``(start, end, kind)`` of the timeline in which no request finished,
    neighbouring intervals of one kind joined: ``idle`` where no request was in flight
    at either end (between waves, while the primary tier is emptied or the tiers
    drain), ``stalled`` where requests were in flight but none finished."""
    spans: list[tuple[float, float, SpanKind]] = []
    for before, after in itertools.pairwise(timeline):
        if after["requests"] != before["requests"]:
            continue
        kind: SpanKind = "stalled" if before["in_flight"] or after["in_flight"] else "idle"
        if spans and spans[-1][1] == before["t"] and spans[-1][2] == kind:
            spans[-1] = (spans[-1][0], after["t"], kind)
        else:
            spans.append((before["t"], after["t"], kind))
    return spans


def draw(reports: Sequence[dict[str, Any]]) -> tuple[Any, int]:
    """The figure :func:`plot` saves, and how many points it holds.

    Top row: the chunk hit rate of each sampling interval, and since the start. Bottom
    row: each secondary tier's GB/s in and out, and as horizontal lines the limits the
    run measured for them (the raw disk's write and read, for an fs tier); a series
    that stays at zero (the primary tier's, whose bytes are the engine's; a p2p tier's
    writes, which are announcements) is left out. On both, the spans in which no
    request finished are shaded, grey where none was in flight (idle) and red where
    some were (stalled). The legends sit beside the axes, never over data.
    """
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, len(reports), figsize=(7 * len(reports), 7), squeeze=False)
    points = 0
    for column, report in enumerate(reports):
        timeline = report["timeline"]
        times = [point["t"] for point in timeline]
        hit_axis, rate_axis = axes[0][column], axes[1][column]
        interval, cumulative = [], []
        for before, after in itertools.pairwise(timeline):
            chunks = after["chunks"] - before["chunks"]
            hits = after["hits"] - before["hits"]
            interval.append(hits / chunks if chunks else float("nan"))
            cumulative.append(after["hits"] / after["chunks"] if after["chunks"] else float("nan"))
        hit_axis.plot(
            times[1:], interval, marker=".", label=f"per {SAMPLE_INTERVAL_S:g} s interval"
        )
        hit_axis.plot(times[1:], cumulative, "--", label="since the start")
        points += len(interval) + len(cumulative)
        shaded: set[SpanKind] = set()
        for start, end, kind in quiet_spans(timeline):
            text, colour = _SPANS[kind]
            for axis in (hit_axis, rate_axis):
                # One legend entry per kind: matplotlib leaves out labels starting "_".
                label = text if kind not in shaded and axis is hit_axis else f"_{text}"
                axis.axvspan(start, end, color=colour, alpha=0.25, linewidth=0, label=label)
            shaded.add(kind)
        hit_axis.set_title(f"{report['workload']}: chunk hit rate")
        hit_axis.set_ylim(0, 1.05)
        hit_axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        drawn = 0
        for label in timeline[0]["tiers"] if timeline else []:
            if label == PRIMARY:
                continue
            for field, style, word in (("bytes_written", "-", "in"), ("bytes_read", "--", "out")):
                speeds = [
                    (after["tiers"][label][field] - before["tiers"][label][field])
                    / max(after["t"] - before["t"], 1e-9)
                    / GB
                    for before, after in itertools.pairwise(timeline)
                ]
                if not any(speeds):
                    continue
                rate_axis.plot(times[1:], speeds, style, marker=".", label=f"{label} {word}")
                points += len(speeds)
                drawn += 1
        physical = report.get("physical", {})
        for limit in BENCH_TIERS.limits():
            if limit.key not in physical:
                continue
            gbps = physical[limit.key]
            style = ":" if limit.direction is Direction.WRITE else "-."
            rate_axis.axhline(
                gbps, color="black", linestyle=style, linewidth=1.5, label=f"{limit.label} {gbps:g}"
            )
            drawn += 1
        rate_axis.set_title("secondary tier throughput (GB/s): in = stored, out = read back")
        rate_axis.set_xlabel("seconds")
        if drawn:
            rate_axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    return figure, points
