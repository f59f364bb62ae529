"""``kvtier bench``: a serving workload replayed through the stack, reported against
the hardware measured in the same run; its options checked before anything starts."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.cli._args import MIB, fail, read_json_object
from kvtier.cli._plan import as_kvtier_reads, engine_spec
from kvtier.errors import KVTierError

if TYPE_CHECKING:
    from rich.console import Console

    from kvtier.bench import BenchSettings

__all__ = ["bench_command"]


class _StderrLog(logging.Handler):
    """Library warnings (a failing tier's) on stderr, one line each, no traceback."""

    def emit(self, record: logging.LogRecord) -> None:
        # The first line: kvtier logs a failure as text, its traceback after it.
        first_line = record.getMessage().split("\n", 1)[0]
        # sys.stderr as it is now: a host (or a test) may have replaced it.
        print(f"kvtier: {first_line}", file=sys.stderr, flush=True)


_STDERR_LOG = _StderrLog(logging.WARNING)


def _log_to_stderr() -> None:
    library = logging.getLogger("kvtier")
    if _STDERR_LOG not in library.handlers:
        library.addHandler(_STDERR_LOG)
    if library.level == logging.NOTSET:
        library.setLevel(logging.WARNING)


def bench_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvtier.bench import BENCH_TIERS, WORKLOADS, BenchSettings
    from kvtier.bench.report import combine, plot
    from kvtier.bench.run import check_root
    from kvtier.bench.settings import TOKENS_PER_BLOCK, bench_config

    known = BENCH_TIERS.names()
    tiers = tuple(name.strip() for name in args.tiers.split(",") if name.strip())
    for name in tiers:
        if name not in known:
            fail(f"--tiers: unknown tier {name!r}; expected some of {', '.join(known)}")
        if tiers.count(name) > 1:
            fail(f"--tiers: {name} is named twice")
    if not tiers:
        fail("--tiers needs at least one tier")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail("--plot needs matplotlib: pip install '.[plot]' in kvtier's checkout")
    if args.metrics_port is not None and not 0 < args.metrics_port < 65536:
        fail(f"--metrics-port must be a TCP port, got {args.metrics_port}")
    # Every place the run writes is checked now, rather than after a run of minutes.
    for option, path in (("--json", args.json_path), ("--plot", args.plot)):
        if path is not None:
            _check_output_file(option, path)
    if args.plot is not None:
        _check_plot_format(args.plot)
    if args.reuse_root and args.root is None:
        fail("--reuse-root needs --root: the default working directory is always new")
    if args.root is not None:
        try:
            check_root(args.root, args.reuse_root)
        except ValueError as exc:
            fail(str(exc))
    extra = read_json_object(args.config) if args.config is not None else {}
    try:
        extra = as_kvtier_reads(extra, TOKENS_PER_BLOCK)
    except KVTierError as exc:
        fail(str(exc))
    settings = BenchSettings(
        tiers=tiers,
        extra_config=extra,
        chunk_bytes=int(args.chunk_mib * MIB),
        primary_bytes=args.primary_mib * MIB,
        working_set_bytes=args.working_set_mib * MIB,
        max_prompt_chunks=args.max_prompt_chunks,
        concurrency=args.concurrency,
        duration_s=args.duration,
        root_dir=args.root,
        reuse_root=args.reuse_root,
        seed=args.seed,
    )
    # A --config file is read as kvtier plan reads it, before anything starts: the tiers
    # --tiers would start are not known yet, so a file without secondary_tiers is
    # checked with none.
    try:
        spec = engine_spec(bench_config(settings, []))
    except KVTierError as exc:
        fail(str(exc))
    # The p2p tier of --tiers spawns a peer engine with a primary tier of its own.
    spawns_peer = "p2p" in tiers and "secondary_tiers" not in extra
    if "cpu_bytes_to_use" in extra:
        sized_by = ("cpu_bytes_to_use", f"cpu_bytes_to_use in {args.config}")
    else:
        sized_by = ("--primary-mib", f"--primary-mib {args.primary_mib}")
    _check_shared_memory(spec.settings.geometry.region_bytes, 2 if spawns_peer else 1, sized_by)
    in_flight = settings.concurrency * settings.max_prompt_chunks * settings.chunk_bytes
    if settings.primary_bytes < in_flight:
        print(
            f"kvtier: warning: --primary-mib {args.primary_mib} is below what the requests "
            f"in flight hold at once ({in_flight / MIB:g} MiB = --concurrency x "
            "--max-prompt-chunks x --chunk-mib): promotions will find no free slot and miss",
            file=sys.stderr,
        )
    # Reports on stdout (to keep or pipe), progress and problems on stderr.
    console = Console(file=sys.stdout)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    _log_to_stderr()
    try:
        reports = asyncio.run(_run_workloads(settings, names, args, console))
    except KVTierError as exc:
        fail(str(exc))
    except ValueError as exc:
        fail(str(exc))
    result = reports[0] if len(reports) == 1 else combine(reports)
    try:
        if args.json_path is not None:
            args.json_path.write_text(json.dumps(result, indent=2) + "\n")
        if args.plot is not None:
            plot(reports, args.plot)
    except OSError as exc:  # checked at the start, but a disk may fill up meanwhile
        fail(f"cannot write {exc.filename}: {exc.strerror}")
    # A combined result names each line's workload already.
    for kind in ("warning", "error"):
        for line in result[f"{kind}s"]:
            print(f"kvtier: {kind}: {line}", file=sys.stderr)
    wrong = sum(report["requests"]["wrong_chunks"] for report in reports)
    if wrong:
        print(f"kvtier: error: {wrong:,} chunks were served with wrong bytes", file=sys.stderr)
    return 1 if wrong or result["errors"] else 0


def _check_output_file(option: str, path: Path) -> None:
    """Refuse now a file the run could not write when it ends, in one line."""
    from kvtier.bench.run import cannot_create_in

    parent = path.parent
    if path.is_dir():
        fail(f"{option} {path}: is a directory")
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        fail(f"{option} {path}: {parent} {what}")
    if path.exists():
        try:
            # Opened without truncating or creating: the file stays as it is until the end.
            with path.open("r+b"):
                pass
        except OSError as exc:
            fail(f"{option} {path}: cannot write it: {exc.strerror}")
        return
    problem = cannot_create_in(parent)
    if problem is not None:
        fail(f"{option} {path}: cannot create it in {parent}: {problem}")


def _check_plot_format(path: Path) -> None:
    """Refuse now a --plot name whose suffix matplotlib cannot write."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = path.suffix.lstrip(".").lower()
    if suffix and suffix not in formats:
        fail(
            f"--plot {path}: matplotlib cannot write .{suffix} files; name a "
            f"{', '.join(f'.{name}' for name in sorted(formats))} file"
        )


def _check_shared_memory(region_bytes: int, engines: int, sized_by: tuple[str, str]) -> None:
    """Refuse now the primary tiers of ``engines`` that ``/dev/shm`` cannot hold, naming
    what sized them (``(option, option with its value)``): the region's own check, at
    start, can only name ``cpu_bytes_to_use``."""
    import mmap

    from kvtier.region import DEFAULT_SHM_DIR

    try:
        stat = os.statvfs(DEFAULT_SHM_DIR)
    except OSError:
        return  # nothing to measure here: the region's own check speaks at start
    free = stat.f_bavail * stat.f_frsize
    # A region is its chunks and one header page.
    needed = engines * (region_bytes + mmap.PAGESIZE)
    if needed <= free:
        return
    option, given = sized_by
    peer = ", the spawned p2p peer's included" if engines > 1 else ""
    fail(
        f"{given}: {DEFAULT_SHM_DIR} has {free / MIB:,.0f} MiB free, the primary tier "
        f"needs {needed / MIB:,.0f} MiB{peer}: lower {option}, or give {DEFAULT_SHM_DIR} "
        "more room (docker run --shm-size, a memory-backed emptyDir)"
    )


async def _run_workloads(
    settings: BenchSettings, names: list[str], args: argparse.Namespace, console: Console
) -> list[dict[str, Any]]:
    from prometheus_client import CollectorRegistry, start_http_server

    from kvtier.bench import run_bench
    from kvtier.bench.report import print_report

    registry = CollectorRegistry()
    server = None
    if args.metrics_port is not None:
        # Loopback only: a benchmark's metrics are for the person running it.
        server, _ = start_http_server(args.metrics_port, addr="127.0.0.1", registry=registry)
    reports = []
    try:
        for name in names:
            run_settings = dataclasses.replace(settings, workload=name)
            if settings.root_dir is not None and len(names) > 1:
                # One directory per workload: none may measure another's cache.
                settings.root_dir.mkdir(exist_ok=True)
                run_settings.root_dir = settings.root_dir / name
            # Each run gets its own registry: metric names repeat across runs.
            run_registry = registry if len(names) == 1 else CollectorRegistry()
            with _progress(name, args.quiet) as (advance, phase):
                report = await run_bench(
                    run_settings, progress=advance, registry=run_registry, phase=phase
                )
                phase(f"done (the replay took {report['duration_s']:.1f} s)")
            reports.append(report)
            # Each run's tables as soon as it ends: --workload all takes minutes.
            print_report(report, console)
            console.file.flush()
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    return reports


_Advance = Callable[[int, int, int], None]
_Phase = Callable[[str], None]


@contextlib.contextmanager
def _progress(workload: str, quiet: bool) -> Iterator[tuple[_Advance, _Phase]]:
    """How a run shows its progress on stderr: ``(advance, phase)`` callbacks.

    On a terminal, a bar that phases relabel; otherwise (CI, a pipe, a log file) a
    flushed line per phase and per tenth of the requests, so a log shows a long run
    moving. Nothing with ``quiet``.
    """
    if quiet:
        yield (lambda done, total, hits: None), (lambda text: None)
        return
    if not sys.stderr.isatty():
        started = time.monotonic()
        shown = 0

        def line(text: str) -> None:
            elapsed = time.monotonic() - started
            print(
                f"kvtier bench: {workload}: {text} [{elapsed:.0f} s]", file=sys.stderr, flush=True
            )

        def tenths(done: int, total: int, hits: int) -> None:
            nonlocal shown
            tenth = done * 10 // max(total, 1)
            if tenth > shown:
                shown = tenth
                line(f"{done:,} of {total:,} requests served, {hits:,} chunks hit")

        yield tenths, line
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn(f"[bold]{workload}[/] {{task.description}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("hit {task.fields[hit]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("", total=None, hit="-")

        def advance(done: int, total: int, hits: int) -> None:
            bar.update(task, completed=done, total=total, hit=f"{hits} chunks")

        def relabel(text: str) -> None:
            bar.update(task, description=text)

        yield advance, relabel
