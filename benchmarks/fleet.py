"""A fleet of engines on one machine sharing their KV cache through one tier at a time.

``--engines`` engine processes (each a ``KVTier`` with its own small primary tier,
``fleet_engine.py``) serve a stream of users: each request lands on a random engine
(seeded), and holds one of ``--prompts`` system prompts (``--prompt-chunks`` chunks,
shared by every user of that prompt) and a suffix of its own (``--suffix-chunks``,
never shared). The requests go out in waves: a wave is ``--in-flight`` requests per
engine on average, served at once, and the next wave starts when every engine has
answered. Each sharing tier in ``--tiers`` is measured in turn, against a fresh server
(``fleet_servers.py``: none for p2p, a shared directory for fs, SeaweedFS or rclone for
s3, memcached, redis-server, mooncake_master), with every fleet size.

What each run reports:

- cross-engine hit rate: of the chunks that another engine held by the end of an
  earlier wave while the requesting engine had never held them, the share the request
  found (through the sharing tier: its own primary tier cannot have them);
- GB/s through the sharing tier: bytes cascaded into it and promoted out of it, by all
  engines, over the run's wall time (the waves, then waiting for the cascades);
- request wait p50 / p99: from a request's lookup until its hits were in the engine's
  primary tier (``KVTier.lookup``), over every request;
- CPU per GiB: the engines' CPU time over the run (their process's user + system
  time) plus the server's, per GiB through the sharing tier. The engines' share includes
  serving the requests (computing and checking chunks), so each fleet size first runs
  a baseline, ``none``: the same requests without a sharing tier; "sharing" is the CPU
  time beyond that baseline, per GiB;
- per engine: established TCP connections (from ``/proc``), the p2p tier's own
  connection gauge, its index (keys peers announced; bytes where the tier reports
  them) and announce traffic, and the tier's other metrics in the JSON.

Every loaded chunk is checked against what its key's computation wrote: "wrong" must
be 0. The table goes to stdout, progress to stderr, the JSON to ``--json`` and, last,
to stdout as one line.

    python benchmarks/fleet.py [--engines 2,4,8,16] [--tiers p2p,fs,s3] [--json OUT]
    python benchmarks/fleet.py --quick --engines 2 --tiers p2p,fs    # a smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from fleet_engine import ENGINE_ENVIRONMENT, EngineRun, engine_main
from fleet_servers import BASELINE, SHARING_TIERS, SharingTier, sharing_tier

from kvtier.bench.probe import percentile
from kvtier.bench.workloads import chain_keys
from kvtier.keys import OffloadKey
from kvtier.tiers.p2p import ANNOUNCE_BYTES, INDEX_MEMORY

__all__ = ["Fleet", "FleetSettings", "build_requests", "main", "run_sweep"]

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
# Starting a process that imports torch: seconds each, many at once on two cores.
START_TIMEOUT_S = 300.0
# Opening an engine, one wave, or waiting for its cascades: seconds on a quiet machine;
# sixteen engines and a server on two cores take many times that.
ANSWER_TIMEOUT_S = 300.0
# A p2p mesh of 16 engines is 240 connections, each with a two-way secret proof.
MESH_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
# Block names: a system prompt's blocks are PROMPT_STRIDE apart from the next
# prompt's; a request's own suffix blocks start at SUFFIX_BASE, far above them.
PROMPT_STRIDE = 1000
SUFFIX_BASE = 1 << 40
# The p2p tier's metrics of its index and its announce traffic (by flow and change),
# as exposed (a counter's samples end in _total).
P2P_INDEX_BYTES = INDEX_MEMORY
P2P_ANNOUNCE_BYTES = f"{ANNOUNCE_BYTES}_total"


@dataclass(frozen=True)
class FleetSettings:
    chunk_bytes: int = 256 * KIB
    # 64 slots: every engine's primary tier fills up at every fleet size, so a p2p
    # engine announces (and its peers index) as many keys as it can hold.
    primary_bytes: int = 16 * MIB
    # 128 shared chunks, twice a primary tier: the fleet's shared set does not fit
    # one engine, so a p2p fleet shares only what its engines still hold.
    prompts: int = 32
    prompt_chunks: int = 4
    suffix_chunks: int = 2
    requests: int = 768
    in_flight: int = 2
    lookup_timeout_s: float = 10.0
    seed: int = 0


QUICK = FleetSettings(primary_bytes=8 * MIB, prompts=4, requests=32)


@dataclass(frozen=True)
class FleetRequest:
    req_id: str
    engine: int
    blocks: tuple[int, ...]


def build_requests(settings: FleetSettings, engines: int) -> list[FleetRequest]:
    """The run's requests in order. The users' prompts are the same for every fleet
    size; which engine each request lands on is drawn per size."""
    prompts = random.Random(settings.seed)
    landing = random.Random(f"{settings.seed}-{engines}")
    requests = []
    for index in range(settings.requests):
        prompt = prompts.randrange(settings.prompts)
        shared = range(prompt * PROMPT_STRIDE, prompt * PROMPT_STRIDE + settings.prompt_chunks)
        first = SUFFIX_BASE + index * settings.suffix_chunks
        own = range(first, first + settings.suffix_chunks)
        requests.append(FleetRequest(f"q{index}", landing.randrange(engines), (*shared, *own)))
    return requests


def waves(requests: Sequence[FleetRequest], size: int) -> Iterator[Sequence[FleetRequest]]:
    for first in range(0, len(requests), size):
        yield requests[first : first + size]


class RunError(Exception):
    """An engine could not do its part of a run (the run is reported as failed)."""


class EngineSilent(Exception):
    """An engine did not answer in time, or exited: its pipe can no longer be trusted
    to pair commands with answers, so the sweep stops."""


# -------------------------------------------------------------------- the fleet


@contextlib.contextmanager
def engine_environment() -> Iterator[None]:
    """:data:`ENGINE_ENVIRONMENT` in this process's environment while the engines
    start (they inherit it), as it was again afterwards."""
    added = {k: v for k, v in ENGINE_ENVIRONMENT.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


class Fleet:
    """Engine processes, started once and reused run after run (torch imports once)."""

    def __init__(self, count: int) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.processes: list[BaseProcess] = []
        self.conns: list[Connection] = []
        with engine_environment():
            self._start(spawn, count)
        self.ask({i: None for i in range(count)}, START_TIMEOUT_S)

    def _start(self, spawn: Any, count: int) -> None:
        for index in range(count):
            ours, theirs = spawn.Pipe()
            process = spawn.Process(
                target=engine_main, args=(index, theirs), name=f"fleet-engine-{index}"
            )
            process.daemon = True
            process.start()
            theirs.close()
            self.processes.append(process)
            self.conns.append(ours)

    @property
    def pids(self) -> list[int]:
        return [process.pid or 0 for process in self.processes]

    def ask(
        self, commands: Mapping[int, tuple[Any, ...] | None], timeout: float = ANSWER_TIMEOUT_S
    ) -> dict[int, Any]:
        """Send each engine its command (None: only read its next answer) and collect
        the answers.

        Raises:
            RunError: an engine answered an error (every answer is read first).
            EngineSilent: an engine did not answer in ``timeout`` seconds, or exited.
        """
        for index, command in commands.items():
            if command is not None:
                self.conns[index].send(command)
        deadline = time.monotonic() + timeout
        answers: dict[int, Any] = {}
        errors: list[str] = []
        for index in commands:
            conn = self.conns[index]
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise EngineSilent(f"engine {index} did not answer in {timeout:.0f} s")
            try:
                status, value = conn.recv()
            except EOFError:
                code = self.processes[index].exitcode
                raise EngineSilent(f"engine {index} exited (exit code {code})") from None
            if status == "ok":
                answers[index] = value
            else:
                errors.append(str(value))
        if errors:
            raise RunError("; ".join(errors))
        return answers

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("exit",))
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(STOP_TIMEOUT_S)
        for conn in self.conns:
            conn.close()


# -------------------------------------------------------------------- one run


@dataclass
class CrossEngine:
    """Which engines held which chunks by the end of each wave, and what requests found."""

    held: dict[OffloadKey, set[int]]
    eligible: int = 0
    hits: int = 0

    def count(self, wave: Sequence[FleetRequest], found: Mapping[str, int]) -> None:
        """Count a wave's requests (``found``: hits by request id), then what it stored."""
        asked: set[tuple[int, OffloadKey]] = set()
        for request in wave:
            for position, key in enumerate(chain_keys(request.blocks)):
                holders = self.held.get(key, set())
                if request.engine in holders or not holders or (request.engine, key) in asked:
                    continue
                # Only the engine's first request for the key in the wave counts: a
                # second may find it in the engine's own primary tier.
                asked.add((request.engine, key))
                self.eligible += 1
                self.hits += position < found[request.req_id]
        for request in wave:
            for key in chain_keys(request.blocks):
                self.held.setdefault(key, set()).add(request.engine)


def run_once(
    fleet: Fleet, entry: SharingTier, engines: int, settings: FleetSettings, workdir: Path
) -> dict[str, Any]:
    """One sharing tier with the first ``engines`` engines of the fleet."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{entry.name}-{engines}-", dir=workdir))
    ids = range(engines)
    with entry.launch(run_dir, engines, settings.chunk_bytes) as store:
        model = f"fleet-{entry.name}-{engines}-{uuid.uuid4().hex[:8]}"
        try:
            fleet.ask(
                {
                    i: (
                        "open",
                        EngineRun(
                            model=model,
                            tier=store.tier_for(i, engines),
                            chunk_bytes=settings.chunk_bytes,
                            primary_bytes=settings.primary_bytes,
                            in_flight=settings.in_flight,
                            max_prompt_chunks=settings.prompt_chunks + settings.suffix_chunks,
                            lookup_timeout_s=settings.lookup_timeout_s,
                        ),
                    )
                    for i in ids
                }
            )
            ready = fleet.ask({i: ("ready", engines - 1, MESH_TIMEOUT_S) for i in ids})
            if not all(ready.values()):
                raise RunError(f"the p2p mesh of {engines} engines did not form")
            server_cpu = store.server_cpu_s()
            fleet.ask({i: ("begin",) for i in ids})
            started = time.perf_counter()
            cross = CrossEngine({})
            served: list[dict[str, Any]] = []
            for wave in waves(build_requests(settings, engines), engines * settings.in_flight):
                mine: dict[int, list[FleetRequest]] = {}
                for request in wave:
                    mine.setdefault(request.engine, []).append(request)
                answers = fleet.ask(
                    {
                        i: ("serve", [(r.req_id, r.blocks) for r in requests])
                        for i, requests in mine.items()
                    }
                )
                found = {}
                for i, requests in mine.items():
                    for request, result in zip(requests, answers[i], strict=True):
                        found[request.req_id] = result["hits"]
                        served.append({**result, "engine": i})
                cross.count(wave, found)
            finals = fleet.ask({i: ("finish",) for i in ids})
            wall_s = time.perf_counter() - started
            server_cpu = store.server_cpu_s() - server_cpu
            server_rss = store.server_rss_bytes()
        except EngineSilent:
            raise
        except BaseException:
            with contextlib.suppress(RunError):
                fleet.ask({i: ("close",) for i in ids})
            raise
        fleet.ask({i: ("close",) for i in ids})
    result = summarize(
        entry.name, engines, served, cross, [finals[i] for i in ids], wall_s, server_cpu
    )
    # Where a server tier keeps its index: one place, whatever the fleet's size.
    result["server_rss_mib"] = server_rss / MIB
    return result


def summarize(
    tier: str,
    engines: int,
    served: Sequence[Mapping[str, Any]],
    cross: CrossEngine,
    finals: Sequence[Mapping[str, Any]],
    wall_s: float,
    server_cpu_s: float,
) -> dict[str, Any]:
    chunks = sum(r["chunks"] for r in served)
    hits = sum(r["hits"] for r in served)
    waits = [r["lookup_s"] for r in served]
    moved = sum(f["tier"]["bytes_read"] + f["tier"]["bytes_written"] for f in finals)
    engine_cpu_s = sum(f["cpu_s"] for f in finals)
    own = [0] * engines
    for result in served:
        own[result["engine"]] += 1
    per_engine = [engine_figures(f, own[i]) for i, f in enumerate(finals)]
    failures = {
        name: sum(f["tier"][name] for f in finals)
        for name in (
            "lookup_failures",
            "promotion_failures",
            "cascade_failures",
            "integrity_failures",
            "stores_dropped",
        )
    }
    return {
        "tier": tier,
        "engines": engines,
        "requests": len(served),
        "chunks": chunks,
        "chunk_hit_rate": hits / chunks if chunks else 0.0,
        "cross_engine_eligible": cross.eligible,
        "cross_engine_hits": cross.hits,
        "cross_engine_hit_rate": cross.hits / cross.eligible if cross.eligible else None,
        "tier_hits": sum(f["tier"]["hits"] for f in finals),
        "tier_bytes_read": sum(f["tier"]["bytes_read"] for f in finals),
        "tier_bytes_written": sum(f["tier"]["bytes_written"] for f in finals),
        "gbps": moved / wall_s / 1e9,
        "gbps_in": sum(f["tier"]["bytes_written"] for f in finals) / wall_s / 1e9,
        "gbps_out": sum(f["tier"]["bytes_read"] for f in finals) / wall_s / 1e9,
        "wall_s": wall_s,
        "wait_p50_ms": percentile(waits, 0.5) * 1e3,
        "wait_p99_ms": percentile(waits, 0.99) * 1e3,
        "engine_cpu_s": engine_cpu_s,
        "server_cpu_s": server_cpu_s,
        "cpu_s_per_gib": (engine_cpu_s + server_cpu_s) / (moved / GIB) if moved else None,
        "wrong_chunks": sum(r["wrong_chunks"] for r in served),
        **failures,
        "per_engine": per_engine,
        "per_engine_mean": _means(per_engine),
    }


def engine_figures(final: Mapping[str, Any], requests: int) -> dict[str, Any]:
    """One engine's connections, index and announce traffic, and its tier's metrics
    (``requests``: how many it served)."""
    metrics: Mapping[str, float] = final["metrics"]
    figures: dict[str, Any] = {
        "requests": requests,
        "tcp_connections": final["tcp_established"],
        "cpu_s": final["cpu_s"],
        "rss_mib": final["rss_bytes"] / MIB,
    }
    p2p = final.get("p2p")
    if p2p is not None:
        figures["p2p_outbound"] = p2p["outbound"]
        figures["p2p_inbound"] = p2p["inbound"]
        figures["indexed_keys"] = p2p["indexed_keys"]
        figures["announced_keys"] = p2p["announced_keys"]
        index = metrics.get(P2P_INDEX_BYTES)
        if index is not None:
            figures["index_bytes"] = index
        traffic = {
            flow: sum(v for k, v in metrics.items() if _is_announce(k, flow))
            for flow in ("sent", "received")
        }
        if any(_is_announce(name, "") for name in metrics):
            figures["announce_bytes_sent"] = traffic["sent"]
            figures["announce_bytes_received"] = traffic["received"]
            # Each announce goes to every peer: per request the engine served, what it
            # sends and receives grows with the peers, at any request rate.
            figures["announce_bytes_per_request"] = (
                (traffic["sent"] + traffic["received"]) / requests if requests else 0.0
            )
    figures.update(metrics)
    return figures


def _is_announce(name: str, flow: str) -> bool:
    return name.startswith(P2P_ANNOUNCE_BYTES) and f"flow={flow}" in name


def _means(per_engine: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each figure's mean over the engines (an engine that lacks one counts 0: a
    counter it never incremented)."""
    names = dict.fromkeys(name for engine in per_engine for name in engine)
    return {
        name: statistics.fmean(float(engine.get(name, 0.0)) for engine in per_engine)
        for name in names
    }


# ------------------------------------------------------------------- the sweep


def run_sweep(
    settings: FleetSettings,
    sizes: Sequence[int],
    tiers: Sequence[str],
    workdir: Path,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Every sharing tier with every fleet size, after the baseline (``none``: the
    engines serving the same requests without a sharing tier) at that size; a run that
    fails is reported with its error (``error``), one that cannot run here with why
    (``skipped``)."""
    entries = [BASELINE, *(sharing_tier(name) for name in tiers)]
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    say(f"fleet: starting {max(sizes)} engine processes")
    fleet = Fleet(max(sizes))
    results: list[dict[str, Any]] = []
    baseline: dict[str, Any] = {}
    try:
        for engines in sizes:
            for entry in entries:
                missing = entry.missing()
                if missing is not None:
                    results.append({"tier": entry.name, "engines": engines, "skipped": missing})
                    say(f"fleet: {entry.name} x {engines}: skipped ({missing})")
                    continue
                started = time.monotonic()
                try:
                    result = run_once(fleet, entry, engines, settings, workdir)
                except (RunError, RuntimeError, OSError) as exc:
                    result = {"tier": entry.name, "engines": engines, "error": str(exc)}
                if entry is BASELINE:
                    baseline = result
                elif "per_engine" in result:
                    result["sharing_cpu_s_per_gib"] = sharing_cpu(result, baseline)
                results.append(result)
                outcome = result.get("error") or f"{time.monotonic() - started:.1f} s"
                say(f"fleet: {entry.name} x {engines}: {outcome}")
    finally:
        fleet.close()
    return results


def sharing_cpu(result: Mapping[str, Any], baseline: Mapping[str, Any]) -> float | None:
    """CPU seconds per GiB through the sharing tier beyond what the engines spent
    serving the same requests without it (the baseline run of the same fleet size):
    the engines' and the server's, over GiB into and out of the tier."""
    moved = float(result["tier_bytes_read"] + result["tier_bytes_written"])
    if "engine_cpu_s" not in baseline or not moved:
        return None
    extra = float(result["engine_cpu_s"] + result["server_cpu_s"] - baseline["engine_cpu_s"])
    return extra / (moved / GIB)


# --------------------------------------------------------------------- report


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _per_engine(result: Mapping[str, Any], *names: str) -> Any:
    means = result["per_engine_mean"]
    for name in names:
        if name in means:
            return means[name]
    return None


COLUMNS = (
    "tier",
    "engines",
    "cross-engine hit rate",
    "GB/s in / out",
    "wait ms p50 / p99",
    "CPU s / GiB all / sharing",
    "TCP conns / engine",
    "index keys / engine",
    "index KiB / engine",
    "announce B / request",
    "wrong",
)


def cells(result: Mapping[str, Any]) -> list[str]:
    """One run's row of the table; a run that failed or was skipped says why."""
    if "per_engine" not in result:
        why = result.get("error") or result.get("skipped")
        return [result["tier"], str(result["engines"]), f"{why}"]
    rate = result["cross_engine_hit_rate"]
    index_bytes = _per_engine(result, "index_bytes")
    return [
        result["tier"],
        str(result["engines"]),
        "-" if rate is None else f"{rate:.1%}",
        f"{_num(result['gbps_in'], 3)} / {_num(result['gbps_out'], 3)}",
        f"{_num(result['wait_p50_ms'], 1)} / {_num(result['wait_p99_ms'], 1)}",
        f"{_num(result['cpu_s_per_gib'], 1)} / {_num(result.get('sharing_cpu_s_per_gib'), 1)}",
        _num(_per_engine(result, "tcp_connections"), 1),
        _num(_per_engine(result, "indexed_keys"), 0),
        _num(None if index_bytes is None else index_bytes / KIB, 1),
        _num(_per_engine(result, "announce_bytes_per_request"), 0),
        str(result["wrong_chunks"]),
    ]


def title(settings: FleetSettings) -> str:
    return (
        f"fleet: {settings.requests} requests, {settings.prompts} system prompts of "
        f"{settings.prompt_chunks} chunks + {settings.suffix_chunks} own, "
        f"{settings.chunk_bytes // KIB} KiB chunks, primary "
        f"{settings.primary_bytes // MIB} MiB per engine"
    )


def report(results: Sequence[Mapping[str, Any]], settings: FleetSettings) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # Eleven columns: wider than a terminal's default 80 when stdout is a file.
    console = Console(width=None if sys.stdout.isatty() else 180)
    table = Table(title=title(settings), title_justify="left")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "tier" else "right")
    for result in results:
        row = cells(result)
        if len(row) < len(COLUMNS):
            # The first engine's error says it; the JSON has them all.
            row[-1] = f"[dim]{escape(row[-1].split('; ')[0][:160])}[/]"
        table.add_row(*row)
    console.print(table)
    console.print(
        "cross-engine hit rate: chunks another engine held (by an earlier wave) and the "
        "requesting engine never had, found through the sharing tier. GB/s: cascaded "
        "into the sharing tier / promoted out of it, all engines, over the run. CPU: "
        "engines + server per GiB in and out; sharing: less the engines' CPU without a "
        "sharing tier (none). announce B / request: p2p announce "
        "traffic an engine sent and received, per request it served.",
        style="dim",
        highlight=False,
    )


def markdown(results: Sequence[Mapping[str, Any]]) -> str:
    """The table as docs/benchmarks/fleet.md records it."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for result in results:
        row = cells(result)
        row += [""] * (len(COLUMNS) - len(row))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="2,4,8,16", help="fleet sizes, comma-separated")
    parser.add_argument(
        "--tiers", default=",".join(SHARING_TIERS), help="sharing tiers, comma-separated"
    )
    parser.add_argument("--chunk-kib", type=int, default=FleetSettings.chunk_bytes // KIB)
    parser.add_argument("--primary-mib", type=int, default=FleetSettings.primary_bytes // MIB)
    parser.add_argument("--prompts", type=int, default=FleetSettings.prompts)
    parser.add_argument("--prompt-chunks", type=int, default=FleetSettings.prompt_chunks)
    parser.add_argument("--suffix-chunks", type=int, default=FleetSettings.suffix_chunks)
    parser.add_argument("--requests", type=int, default=FleetSettings.requests)
    parser.add_argument("--in-flight", type=int, default=FleetSettings.in_flight)
    parser.add_argument("--seed", type=int, default=FleetSettings.seed)
    parser.add_argument("--root", type=Path, default=None, help="where the runs' files go")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--markdown", type=Path, default=None, help="write the table here, as a Markdown table"
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    args = parser.parse_args(argv)
    try:
        args.sizes = [int(size) for size in args.engines.split(",")]
    except ValueError:
        parser.error(f"--engines: expected comma-separated integers, got {args.engines!r}")
    if any(size < 2 for size in args.sizes):
        parser.error("--engines: a fleet has at least 2 engines")
    least = {"chunk_kib": 1, "primary_mib": 1, "prompts": 1, "prompt_chunks": 1}
    least.update({"suffix_chunks": 0, "requests": 1, "in_flight": 1})
    for option, minimum in least.items():
        if getattr(args, option) < minimum:
            parser.error(f"--{option.replace('_', '-')}: expected at least {minimum}")
    if args.prompt_chunks >= PROMPT_STRIDE:
        parser.error(f"--prompt-chunks: expected fewer than {PROMPT_STRIDE}")
    args.tier_names = [name.strip() for name in args.tiers.split(",") if name.strip()]
    for name in args.tier_names:
        if name not in SHARING_TIERS:
            parser.error(
                f"--tiers: unknown sharing tier {name!r} (known: {', '.join(SHARING_TIERS)})"
            )
    return args


def settings_of(args: argparse.Namespace) -> FleetSettings:
    if args.quick:
        return replace(QUICK, seed=args.seed)
    return FleetSettings(
        chunk_bytes=args.chunk_kib * KIB,
        primary_bytes=args.primary_mib * MIB,
        prompts=args.prompts,
        prompt_chunks=args.prompt_chunks,
        suffix_chunks=args.suffix_chunks,
        requests=args.requests,
        in_flight=args.in_flight,
        seed=args.seed,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    settings = settings_of(args)
    with contextlib.ExitStack() as stack:
        if args.root is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-fleet-")))
        else:
            workdir = args.root
            workdir.mkdir(parents=True, exist_ok=True)
        results = run_sweep(settings, args.sizes, args.tier_names, workdir)
    report(results, settings)
    document = {"settings": asdict(settings), "machine": machine(), "runs": results}
    if args.json is not None:
        args.json.write_text(json.dumps(document, indent=1))
    if args.markdown is not None:
        args.markdown.write_text(markdown(results))
    print(json.dumps(document))


def machine() -> dict[str, Any]:
    import os
    import platform

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


if __name__ == "__main__":
    main()
