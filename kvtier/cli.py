"""The ``kvtier`` command line.

- ``kvtier bench`` replays a serving workload through the whole stack and reports hit
  rates, throughput and tail latency against the hardware measured in the same run.
- ``kvtier inspect ROOT_DIR`` lists what an fs tier holds, and with ``--verify`` checks
  every chunk file's checksum.
- ``kvtier plan`` checks a configuration and prints the primary region it describes.

Reports go to stdout; progress, warnings and errors to stderr (without a terminal, a
flushed line per phase). A bad argument or configuration is one line on stderr and exit
code 2; a reader that stops early (``| head``) ends the command quietly with code 141,
as SIGPIPE would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import enum
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from kvtier import __version__
from kvtier.config import OffloadingConfig
from kvtier.errors import KVTierError
from kvtier.tiering.runner import RunnerSettings

if TYPE_CHECKING:
    from rich.console import Console

    from kvtier.bench import BenchSettings
    from kvtier.specs.base import OffloadingSpec
    from kvtier.specs.settings import TierConfig

__all__ = ["main"]

MIB = 1 << 20


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvtier: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _spoken_list(words: Sequence[str]) -> str:
    """``a, b and c``."""
    return " and ".join([", ".join(words[:-1]), words[-1]]) if len(words) > 1 else "".join(words)


def _build_parser() -> argparse.ArgumentParser:
    from kvtier.bench import BENCH_TIERS, WORKLOADS

    parser = _Parser(prog="kvtier", description="Multi-tier KV-cache offloading for LLM serving.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    bench = commands.add_parser(
        "bench",
        help="replay a serving workload through the tiers and report hit rates and throughput",
        description="Replay a serving workload through KVTier (primary tier + secondary tiers) "
        "the way an async serving engine would, then report per-tier hit rates, GB/s, "
        "latency percentiles and event-loop lag against the disk and memory bandwidth "
        "measured in the same run. Without a GPU, CPU tensors stand in for it.",
    )
    bench.add_argument(
        "--workload",
        choices=[*WORKLOADS, "all"],
        default="multi-round-qa",
        help="which workload to replay (default: multi-round-qa)",
    )
    bench.add_argument(
        "--tiers",
        default="fs",
        help="comma-separated secondary tiers, in lookup order, from "
        f"{_spoken_list(BENCH_TIERS.names())} "
        "(default: fs); s3 starts a local S3 server, p2p a peer engine on loopback",
    )
    bench.add_argument(
        "--config",
        type=Path,
        help="JSON file of extra_config keys to apply; a secondary_tiers list there "
        "replaces --tiers (to benchmark real endpoints and peers)",
    )
    bench.add_argument(
        "--chunk-mib", type=_positive_float, default=1.0, help="bytes per chunk, MiB (1)"
    )
    bench.add_argument(
        "--primary-mib", type=_positive_int, default=1024, help="primary tier, MiB (1024)"
    )
    bench.add_argument(
        "--working-set-mib", type=_positive_int, default=3072, help="distinct data, MiB (3072)"
    )
    bench.add_argument(
        "--max-prompt-chunks", type=_positive_int, default=64, help="longest prompt (64)"
    )
    bench.add_argument(
        "--concurrency", type=_positive_int, default=4, help="requests in flight (4)"
    )
    bench.add_argument(
        "--duration", type=_positive_float, default=180.0, help="stop after this many seconds (180)"
    )
    bench.add_argument(
        "--root",
        type=Path,
        help="working directory: the fs tier (ROOT/fs), the local S3 server's data "
        "(ROOT/s3); new or empty unless --reuse-root; created if missing, its parent "
        "never (default: a temporary one, removed after the run)",
    )
    bench.add_argument(
        "--reuse-root",
        action="store_true",
        help="start from the cache an earlier run left in --root (a warm start: more hits)",
    )
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument(
        "--json", dest="json_path", type=Path, help="also write the report as JSON here"
    )
    bench.add_argument(
        "--plot", type=Path, help="draw hit rate and throughput over time (needs matplotlib)"
    )
    bench.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT"
    )
    bench.add_argument("--quiet", action="store_true", help="no progress on stderr")

    inspect = commands.add_parser(
        "inspect",
        help="list what an fs tier's root_dir holds; --verify checks every chunk",
        description="List the namespaces, chunk counts and bytes under an fs tier's root_dir. "
        "With --verify, read every chunk file and check its header and checksum.",
    )
    inspect.add_argument("root_dir", type=Path)
    inspect.add_argument("--verify", action="store_true", help="check every file's checksum")
    inspect.add_argument("--json", action="store_true", help="print the result as JSON")

    plan = commands.add_parser(
        "plan",
        help="check a configuration and show the primary region it describes",
        description="Validate an extra_config the way the engine reads it and print the "
        "chunk geometry and region size it yields.",
    )
    plan.add_argument(
        "--config",
        type=Path,
        help="JSON file holding the extra_config (kv_connector_extra_config) mapping",
    )
    plan.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="set one extra_config key (value parsed as JSON, else taken as a string)",
    )
    plan.add_argument(
        "--kv-bytes-per-block", type=int, required=True, help="bytes one worker holds per GPU block"
    )
    plan.add_argument("--tokens-per-block", type=int, default=16)
    plan.add_argument("--world-size", type=int, default=1)
    plan.add_argument("--engine-id", default="plan")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def _fail(message: str) -> NoReturn:
    print(f"kvtier: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except OSError as exc:
        _fail(f"cannot read {path}: {exc.strerror}")
    except json.JSONDecodeError as exc:
        _fail(f"{path} is not valid JSON: {exc}")
    if not isinstance(loaded, dict):
        _fail(f"{path} must hold a JSON object (the extra_config mapping)")
    return loaded


# --------------------------------------------------------------------- bench


class _StderrLog(logging.Handler):
    """Library warnings (a failing tier's) on stderr, one line each, no traceback."""

    def emit(self, record: logging.LogRecord) -> None:
        from kvtier._logs import describe_error

        # The first line: a failure's traceback follows it in the message.
        first_line = record.getMessage().split("\n", 1)[0]
        text = f"kvtier: {first_line}"
        if record.exc_info and record.exc_info[1] is not None:
            text += f": {describe_error(record.exc_info[1])}"
        # sys.stderr as it is now: a host (or a test) may have replaced it.
        print(text, file=sys.stderr, flush=True)


_STDERR_LOG = _StderrLog(logging.WARNING)


def _log_to_stderr() -> None:
    library = logging.getLogger("kvtier")
    if _STDERR_LOG not in library.handlers:
        library.addHandler(_STDERR_LOG)
    if library.level == logging.NOTSET:
        library.setLevel(logging.WARNING)


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvtier.bench import BENCH_TIERS, WORKLOADS, BenchSettings
    from kvtier.bench.report import combine, plot
    from kvtier.bench.run import check_root
    from kvtier.bench.settings import TOKENS_PER_BLOCK, bench_config

    known = BENCH_TIERS.names()
    tiers = tuple(name.strip() for name in args.tiers.split(",") if name.strip())
    for name in tiers:
        if name not in known:
            _fail(f"--tiers: unknown tier {name!r}; expected some of {', '.join(known)}")
        if tiers.count(name) > 1:
            _fail(f"--tiers: {name} is named twice")
    if not tiers:
        _fail("--tiers needs at least one tier")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _fail("--plot needs matplotlib: pip install '.[plot]' in kvtier's checkout")
    if args.metrics_port is not None and not 0 < args.metrics_port < 65536:
        _fail(f"--metrics-port must be a TCP port, got {args.metrics_port}")
    # Every place the run writes is checked now, rather than after a run of minutes.
    for option, path in (("--json", args.json_path), ("--plot", args.plot)):
        if path is not None:
            _check_output_file(option, path)
    if args.plot is not None:
        _check_plot_format(args.plot)
    if args.reuse_root and args.root is None:
        _fail("--reuse-root needs --root: the default working directory is always new")
    if args.root is not None:
        try:
            check_root(args.root, args.reuse_root)
        except ValueError as exc:
            _fail(str(exc))
    extra = _read_json_object(args.config) if args.config is not None else {}
    try:
        extra = _as_kvtier_reads(extra, TOKENS_PER_BLOCK)
    except KVTierError as exc:
        _fail(str(exc))
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
        spec = _engine_spec(bench_config(settings, []))
    except KVTierError as exc:
        _fail(str(exc))
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
        _fail(str(exc))
    except ValueError as exc:
        _fail(str(exc))
    result = reports[0] if len(reports) == 1 else combine(reports)
    try:
        if args.json_path is not None:
            args.json_path.write_text(json.dumps(result, indent=2) + "\n")
        if args.plot is not None:
            plot(reports, args.plot)
    except OSError as exc:  # checked at the start, but a disk may fill up meanwhile
        _fail(f"cannot write {exc.filename}: {exc.strerror}")
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
        _fail(f"{option} {path}: is a directory")
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        _fail(f"{option} {path}: {parent} {what}")
    if path.exists():
        try:
            # Opened without truncating or creating: the file stays as it is until the end.
            with path.open("r+b"):
                pass
        except OSError as exc:
            _fail(f"{option} {path}: cannot write it: {exc.strerror}")
        return
    problem = cannot_create_in(parent)
    if problem is not None:
        _fail(f"{option} {path}: cannot create it in {parent}: {problem}")


def _check_plot_format(path: Path) -> None:
    """Refuse now a --plot name whose suffix matplotlib cannot write."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = path.suffix.lstrip(".").lower()
    if suffix and suffix not in formats:
        _fail(
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
    _fail(
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


# ------------------------------------------------------------------- inspect


def _inspect(args: argparse.Namespace) -> int:
    from kvtier.cache_inspect import hint, inspect_root

    try:
        reports = inspect_root(args.root_dir, verify=args.verify)
    except (FileNotFoundError, NotADirectoryError) as exc:
        _fail(str(exc))
    if not reports:
        # An error, not an empty listing: a script must be able to tell a wrong path
        # from an empty cache (a started tier has a namespace, even with no chunk).
        _fail(f"{args.root_dir}: no kvtier cache (no */namespace.json); {hint(args.root_dir)}")
    if args.json:
        print(json.dumps([asdict(report) for report in reports], indent=2))
    else:
        for report in reports:
            print(f"{report.directory}")
            print(f"  namespace  {report.namespace}")
            print(f"  chunks     {report.chunks:,} ({report.bytes / 1e9:.3f} GB)")
            if report.temporary_files:
                left = report.temporary_files
                print(f"  temporary  {left} (left by writers that died; removed at next start)")
            if report.verified is not None and report.bad is not None:
                print(f"  verified   {report.verified:,} good, {len(report.bad):,} bad")
                for name, problem in sorted(report.bad.items()):
                    print(f"    {name}: {problem}")
            else:
                print("  verified   not checked (--verify reads every chunk)")
    return 1 if any(report.bad for report in reports) else 0


# ---------------------------------------------------------------------- plan


def _as_kvtier_reads(extra: Mapping[str, Any], tokens_per_block: int) -> dict[str, Any]:
    """A file's ``extra_config`` as kvtier's spec will receive it.

    A configuration written for vLLM that loads kvtier's adapter (``spec_module_path``
    ``kvtier.integrations.vllm``) is read as the adapter reads it, vLLM's own keys
    translated, without importing vLLM: what the adapter hands kvtier is then checked
    like any other file. ``kvtier plan`` and ``kvtier bench --config`` both read a file
    through here and :func:`_engine_spec`, so they accept and refuse the same files
    with the same messages.

    Raises:
        ConfigError: a vLLM key the adapter refuses.
    """
    from kvtier.integrations.vllm_config import adapter_extra_config, names_adapter

    if names_adapter(extra):
        return adapter_extra_config(extra, tokens_per_block)
    return dict(extra)


def _engine_spec(config: OffloadingConfig) -> OffloadingSpec:
    """The spec the engine builds for ``config``: ``extra_config`` parsed and checked
    the way the engine reads it, connecting to nothing and opening nothing; a bare
    file's spec named by :func:`~kvtier.specs.factory.with_spec_name`.

    Raises:
        ConfigError: as the engine would raise it; for one of vLLM's keys given to a
            kvtier spec, saying where that key belongs.
    """
    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm_config import vllm_key_hint
    from kvtier.specs.factory import OffloadingSpecFactory

    try:
        return OffloadingSpecFactory.create_spec(config)
    except ConfigError as exc:
        spec_name = str(config.extra_config.get("spec_name", "CPUOffloadingSpec"))
        hint = vllm_key_hint(exc.path, spec_name) if exc.problem.startswith("unknown") else None
        if hint is None:
            raise
        raise ConfigError(exc.path, f"unknown setting: {hint}") from None


def _plan(args: argparse.Namespace) -> int:
    from kvtier.integrations.vllm_config import (
        ADAPTER_MODULE,
        ADAPTER_SPEC,
        VLLM_KEYS,
        names_adapter,
    )
    from kvtier.specs.factory import with_spec_name

    extra = _read_json_object(args.config) if args.config is not None else {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            _fail(f"--set expects KEY=VALUE, got {item!r}")
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            extra[key] = value
    try:
        config = OffloadingConfig(
            engine_id=args.engine_id,
            kv_bytes_per_block=args.kv_bytes_per_block,
            tokens_per_block=args.tokens_per_block,
            world_size=args.world_size,
            extra_config=with_spec_name(_as_kvtier_reads(extra, args.tokens_per_block)),
        )
        spec = _engine_spec(config)
    except KVTierError as exc:
        _fail(str(exc))
    settings = spec.settings
    geometry = settings.geometry
    plan: dict[str, Any] = {"spec": type(spec).__name__}
    if names_adapter(extra):
        # What vLLM loads, and the keys it reads itself (unchecked here: vLLM's own).
        plan["vllm_spec"] = f"{ADAPTER_MODULE}.{ADAPTER_SPEC}"
        plan["vllm_keys"] = {
            key: extra[key]
            for key in sorted(VLLM_KEYS - {"spec_name", "spec_module_path"})
            if key in extra
        }
    plan |= {
        "cpu_bytes_to_use": settings.cpu_bytes_to_use,
        "block_size": settings.block_size,
        "eviction_policy": settings.eviction_policy,
        "cache_policy_module_path": settings.cache_policy_module_path,
        "store_threshold": settings.store_threshold,
        "offload_prompt_only": settings.offload_prompt_only,
        "recompute_s_per_chunk": settings.recompute_s_per_chunk,
        "max_pending_s": settings.max_pending_s,
        "backpressure": _jsonable(settings.backpressure),
        "tokens_per_chunk": geometry.tokens_per_chunk,
        "blocks_per_chunk": geometry.blocks_per_chunk,
        "world_size": geometry.world_size,
        "column_bytes": geometry.column_bytes,
        "chunk_bytes": geometry.chunk_bytes,
        "num_chunks": geometry.num_chunks,
        "region_bytes": geometry.region_bytes,
        "unused_bytes": settings.cpu_bytes_to_use - geometry.region_bytes,
        "tokens_cached": geometry.num_chunks * geometry.tokens_per_chunk,
    }
    tiers = [_plan_tier(tier) for tier in settings.tiers]
    if args.json:
        print(json.dumps({**plan, "tiers": tiers}, indent=2))
        return 0
    width = max(len(key) for key in plan)
    for key, value in plan.items():
        print(f"{key:<{width}}  {_shown(value)}")
    print(f"{'tiers':<{width}}  {len(tiers) or 'none (the primary tier only)'}")
    for tier in tiers:
        print(f"tier {tier['label']}  {tier['class']} ({tier['locality']})")
        rows = {key: tier[key] for key in _RUNNER_FIELDS}
        rows["backpressure"] = tier["backpressure"] or "off"
        if tier["settings"] is not None:
            rows.update(tier["settings"])
        else:
            rows["parameters"] = (
                f"{', '.join(tier['parameters']) or 'none'} (read by the tier when it is built)"
            )
        row_width = max(len(key) for key in rows)
        for key, value in rows.items():
            print(f"  {key:<{row_width}}  {_shown(value)}")
    return 0


def _plan_tier(tier: TierConfig) -> dict[str, Any]:
    """One secondary tier as the engine will run it: every value, defaults included."""
    return {
        "label": tier.label,
        "type": tier.type_name,
        "class": f"{tier.tier_class.__module__}.{tier.tier_class.__qualname__}",
        "locality": tier.locality,
        **_as_data(tier.runner),
        "backpressure": _jsonable(tier.backpressure),
        "settings": _jsonable(tier.settings),
        # Only the names of what a tier without settings reads itself: its values may
        # hold credentials under names no redaction knows.
        "parameters": sorted(tier.params) if tier.settings is None else None,
    }


_RUNNER_FIELDS = tuple(f.name for f in dataclasses.fields(RunnerSettings))


def _jsonable(value: Any) -> Any:
    """``value`` as JSON-ready data, credentials hidden."""
    from kvtier._secrets import redact

    return redact(_as_data(value))


def _as_data(value: Any) -> Any:
    """``value`` as dicts, lists and scalars (credentials are left to redact)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _as_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_data(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def _shown(value: Any) -> str:
    """A value in the text plan: strings bare (unless empty), counts with thousands
    separators, None as "not set", the rest as JSON."""
    if value is None:
        return "not set"
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return json.dumps(value)


#: The exit code of a command whose reader went away (``kvtier plan --json | head``):
#: what a shell reports for a process ended by SIGPIPE, as ``yes | head`` gives.
#: Not 1, which ``kvtier inspect --verify`` and ``kvtier bench`` give for bad chunks.
_SIGPIPE_EXIT = 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    handlers = {"bench": _bench, "inspect": _inspect, "plan": _plan}
    try:
        args = _build_parser().parse_args(argv)
        code = handlers[args.command](args)
        # Inside the try: a reader that left early breaks the pipe here, not in the
        # flush at exit, where Python could only print a traceback about it.
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        return _SIGPIPE_EXIT
    return code


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the flush at exit has nowhere to fail.

    What Python's documentation of SIGPIPE advises for a command piped into ``head``.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        # A stdout without a descriptor (a host's stream object) has no exit flush to fail.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
