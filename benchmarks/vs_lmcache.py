"""LMCache 0.5.6's storage adapters beside kvtier's fs tier, on the same disk, in one run.

Three sides move the same bytes, in the same batches, through the same directory tree:

* ``lmcache_fs``: LMCache's Python filesystem adapter (``{"type": "fs"}``);
* ``lmcache_fs_native``: its C++ one (``{"type": "fs_native"}``);
* ``kvtier``: kvtier's fs tier at its defaults (``{"type": "fs", "root_dir": ...}``).

LMCache's side is driven as ``lmcache bench l2`` drives an adapter (its
``l2_adapter_bench``): the adapter built from the same JSON through
``create_l2_adapter`` over one L1 buffer aligned to 4 KiB (``--l1-align-bytes 4096``),
the store objects and the load objects views into it, one submit of ``--keys`` objects
per batch (its ``--num-keys``, ``--in-flight 1``), the clock running from the submit
until its eventfd says the batch is done (its own wait functions). kvtier's side is its
fs tier driven directly, as the manager drives it: the tier built from a
:class:`~kvtier.TierContext` over a primary region (:class:`~kvtier.SharedOffloadRegion`,
``--keys`` rows), each batch one :class:`~kvtier.TransferJob` of ``--keys`` chunks
(``tier.store`` from the rows, ``tier.load`` into them). Each side runs in this process,
in turn, with nothing of the others left open.

Per side and run, in a fresh directory under ``--root``: ``--batches`` batches stored
(plus one warm-up batch, not counted: it starts the threads), ``os.sync()``, every file
under the directory evicted from the page cache (``posix_fadvise(DONTNEED)``; the page
cache as a whole is left alone, as other work may be measuring on the machine), then the
same batches loaded back in the same order. Before each store batch the harness copies
that batch's bytes into the side's store buffers, and before each load batch it zeroes
the load buffers; after each load batch it compares every object byte for byte with
what was stored (each object a distinct 4 KiB-shifted window of one random pool). None
of that is inside a batch's clock or its CPU time, which is the whole process's
(``getrusage``, every thread) over the batch's submit-to-done window, summed.

LMCache's bench checks one round of constant-byte objects; here every object of every
side is checked, and an object that did not load, or loaded other bytes, is a mismatch.
kvtier's tier checks each chunk's xxh3 checksum itself and refuses a corrupt one (a
miss, ``integrity_failures``); LMCache's files carry no checksum. ``--corrupt N`` flips
one byte of N stored files per side before the loads, to show what each side does.

Modes: ``odirect`` (LMCache ``"use_odirect": true``; kvtier at its defaults, which probe
the filesystem and use O_DIRECT where it is supported) and ``pagecache`` (LMCache
``"use_odirect": false``; kvtier ``"o_direct": false``, labelled as such). The sides
alternate, ``lmcache_fs``, ``lmcache_fs_native``, ``kvtier``, ``--runs`` times for each
object size and mode; GB/s and CPU per GiB are the medians of the runs, the per-batch
p50 / p99 are over every measured batch of every run.

The last line is one JSON object (also written to ``--json``): for each ``<size>MiB_<mode>``
and side, ``..._<side>_store_gbps`` / ``_load_gbps``, ``_store_cpu_s_per_gib`` /
``_load_cpu_s_per_gib``, ``_store_p50_ms`` / ``_store_p99_ms`` / ``_load_p50_ms`` /
``_load_p99_ms``, ``_mismatches``, ``_integrity_failures``, ``_o_direct``; ``..._ratio_<figure>``
(kvtier over the best LMCache adapter), and ``kvtier_ahead`` with the lines where it is
not (``kvtier_behind``).

    .nox/lmcache/bin/python benchmarks/vs_lmcache.py --root /path/on/the/disk/to/measure
    .nox/lmcache/bin/python benchmarks/vs_lmcache.py --quick      # a few seconds
"""

from __future__ import annotations

import os

# LMCache reports usage to its developers' server unless told not to; set before it loads.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
# Its INFO lines go to stdout, where the table and the JSON line are.
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import argparse
import asyncio
import json
import resource
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy

from kvtier import SharedOffloadRegion, TierContext, TransferJob, make_offload_key
from kvtier.bench.probe import percentile
from kvtier.tiers.fs import FileSystemTier

MIB = 1 << 20
GIB = 1 << 30
PAGE = 4096
LMCACHE_SIDES = ("lmcache_fs", "lmcache_fs_native")
SIDES = (*LMCACHE_SIDES, "kvtier")
MODES = ("odirect", "pagecache")
#: LMCache's bench waits this long for a batch (its runners' timeout).
BATCH_TIMEOUT_S = 120.0

#: Each figure: its label in the table, its format, and whether more is better.
FIGURES: dict[str, tuple[str, str, bool]] = {
    "store_gbps": ("store GB/s", "{:.2f}", True),
    "load_gbps": ("load GB/s", "{:.2f}", True),
    "store_cpu_s_per_gib": ("CPU s/GiB store", "{:.3f}", False),
    "load_cpu_s_per_gib": ("CPU s/GiB load", "{:.3f}", False),
    "store_p50_ms": ("store batch p50 ms", "{:.1f}", False),
    "store_p99_ms": ("store batch p99 ms", "{:.1f}", False),
    "load_p50_ms": ("load batch p50 ms", "{:.1f}", False),
    "load_p99_ms": ("load batch p99 ms", "{:.1f}", False),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=None, help="directory on the disk to test")
    parser.add_argument("--sizes", default="1,2", help="object sizes in MiB, comma-separated")
    parser.add_argument("--modes", default=",".join(MODES), help="odirect, pagecache or both")
    parser.add_argument(
        "--sides", default=",".join(SIDES), help="a subset of the sides, to profile one"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of each side, alternating")
    parser.add_argument("--batches", type=int, default=16, help="measured batches per run")
    parser.add_argument(
        "--keys", type=int, default=32, help="objects per batch (LMCache's --num-keys)"
    )
    parser.add_argument(
        "--corrupt", type=int, default=0, help="flip a byte in this many files per side"
    )
    parser.add_argument("--quick", action="store_true", help="a run of a few seconds")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.runs, args.batches, args.keys = "1", 1, 2, 8
    args.sizes = [float(size) for size in args.sizes.split(",")]
    args.modes = args.modes.split(",")
    if set(args.modes) - set(MODES):
        parser.error(f"--modes takes {', '.join(MODES)}")
    args.sides = args.sides.split(",")
    if set(args.sides) - set(SIDES):
        parser.error(f"--sides takes {', '.join(SIDES)}")
    return args


# ---------------------------------------------------------------- the bytes


class Payloads:
    """A distinct object for every index: a window of one random pool, shifted a page
    per index, so that an object loaded from the wrong file differs as well."""

    def __init__(self, object_bytes: int, count: int, seed: int = 0) -> None:
        rng = numpy.random.default_rng(seed)
        self._pool = rng.integers(0, 256, object_bytes + count * PAGE, dtype=numpy.uint8)
        self.object_bytes = object_bytes
        self.count = count

    def __getitem__(self, index: int) -> numpy.ndarray[Any, Any]:
        start = index * PAGE
        return self._pool[start : start + self.object_bytes]


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Phase:
    """One direction of one run: each measured batch's seconds and CPU seconds."""

    batch_s: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    nbytes: int = 0

    def add(self, seconds: float, cpu: float, nbytes: int) -> None:
        self.batch_s.append(seconds)
        self.cpu_s += cpu
        self.nbytes += nbytes

    def gbps(self) -> float:
        return self.nbytes / sum(self.batch_s) / 1e9 if self.batch_s else 0.0

    def cpu_per_gib(self) -> float:
        return self.cpu_s / (self.nbytes / GIB) if self.nbytes else 0.0


@dataclass
class SideRun:
    store: Phase = field(default_factory=Phase)
    load: Phase = field(default_factory=Phase)
    mismatches: int = 0
    integrity_failures: int = 0
    o_direct: bool = False


def evict(directory: Path) -> None:
    """Sync, then evict every file under ``directory`` from the page cache."""
    os.sync()
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def corrupt_files(directory: Path, count: int, object_bytes: int) -> list[Path]:
    """Flip the last byte (payload on every side) of ``count`` stored object files."""
    files = sorted(
        path
        for path in directory.rglob("*")
        if path.is_file() and path.stat().st_size >= object_bytes
    )[:count]
    for path in files:
        with path.open("r+b") as file:
            file.seek(-1, os.SEEK_END)
            last = file.read(1)[0]
            file.seek(-1, os.SEEK_END)
            file.write(bytes([last ^ 0xFF]))
    return files


# ----------------------------------------------------------------- the sides


class Side:
    """What the harness needs of a side; batches are numbered from 0 (the warm-up)."""

    o_direct: bool

    def store_batch(self, batch: int, payloads: Payloads) -> tuple[float, float]:
        raise NotImplementedError

    def load_batch(self, batch: int, payloads: Payloads) -> tuple[float, float, int]:
        raise NotImplementedError

    def integrity_failures(self) -> int:
        return 0

    def close(self) -> None:
        raise NotImplementedError


class LMCacheSide(Side):
    """One LMCache L2 adapter, over an L1 buffer, as ``lmcache bench l2`` builds it."""

    def __init__(self, adapter: str, directory: Path, object_bytes: int, keys: int, odirect: bool):
        from lmcache.cli.commands.bench.l2_adapter_bench import data, runner
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

        self._data, self._runner = data, runner
        spec = json.dumps({"type": adapter, "base_path": str(directory), "use_odirect": odirect})
        config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec]))
        self._buffer = data.make_aligned_tensor(2 * keys * object_bytes, PAGE)
        self.adapter = create_l2_adapter(
            config.adapters[0], l1_memory_desc=data.create_l1_memory_desc(self._buffer, PAGE)
        )
        self._store = data.make_memory_objects(self._buffer, keys, object_bytes, 0)
        self._load = data.make_memory_objects(
            self._buffer, keys, object_bytes, keys * object_bytes, fill_offset=1
        )
        self._keys = keys
        self.o_direct = odirect

    def _object_keys(self, batch: int) -> list[Any]:
        return self._data.make_object_keys(self._keys, key_offset=batch * self._keys)

    def store_batch(self, batch: int, payloads: Payloads) -> tuple[float, float]:
        for i, obj in enumerate(self._store):
            obj.raw_data.numpy()[:] = payloads[batch * self._keys + i]
        keys = self._object_keys(batch)
        cpu, started = cpu_seconds(), time.perf_counter()
        task = self.adapter.submit_store_task(keys, self._store)
        done = self._runner._wait_store_finished(self.adapter, [task], BATCH_TIMEOUT_S)
        seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
        if task not in done or not done[task].is_successful():
            raise RuntimeError(f"LMCache's store of batch {batch} failed or timed out")
        return seconds, cpu

    def load_batch(self, batch: int, payloads: Payloads) -> tuple[float, float, int]:
        for obj in self._load:
            obj.raw_data.zero_()
        keys = self._object_keys(batch)
        cpu, started = cpu_seconds(), time.perf_counter()
        task = self.adapter.submit_load_task(keys, self._load)
        self._runner._wait_load_finished(self.adapter, [task], BATCH_TIMEOUT_S)
        seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
        wrong = sum(
            not numpy.array_equal(obj.raw_data.numpy(), payloads[batch * self._keys + i])
            for i, obj in enumerate(self._load)
        )
        return seconds, cpu, wrong

    def close(self) -> None:
        self.adapter.close()


class KVTierSide(Side):
    """kvtier's fs tier over a primary region, one transfer job a batch."""

    def __init__(self, directory: Path, object_bytes: int, keys: int, odirect: bool):
        self._keys = keys
        self.region = SharedOffloadRegion(
            f"vs-lmcache-{uuid.uuid4().hex[:8]}",
            num_chunks=keys,
            chunk_bytes=object_bytes,
            column_bytes=object_bytes,
            world_size=1,
            rank=None,
        )
        self._rows = numpy.frombuffer(self.region.rows, numpy.uint8).reshape(keys, object_bytes)
        self.ctx = TierContext(self.region.primary_view, object_bytes, "vs-lmcache", "1:fs")
        # {"type": "fs", "root_dir": ...} at its defaults (the framework takes "type";
        # the tier never sees it); the page-cache mode turns O_DIRECT off, nothing else.
        params: dict[str, Any] = {"root_dir": str(directory)}
        if not odirect:
            params["o_direct"] = False
        self.tier = FileSystemTier(self.ctx, FileSystemTier.settings_for(self.ctx, params))
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._start())
        self.o_direct = self.tier.o_direct
        self._jobs = 0

    async def _start(self) -> None:
        await self.tier.start()
        await self.tier.wait_scanned()

    def _job(self, batch: int, is_promotion: bool) -> TransferJob:
        self._jobs += 1
        keys = tuple(make_offload_key(f"{batch}:{i}".encode()) for i in range(self._keys))
        return TransferJob(self._jobs, keys, tuple(range(self._keys)), is_promotion, f"b{batch}")

    async def _timed(self, run: Callable[[TransferJob], Any], job: TransferJob) -> Any:
        cpu, started = cpu_seconds(), time.perf_counter()
        result = await run(job)
        return time.perf_counter() - started, cpu_seconds() - cpu, result

    def store_batch(self, batch: int, payloads: Payloads) -> tuple[float, float]:
        for i in range(self._keys):
            self._rows[i] = payloads[batch * self._keys + i]
        job = self._job(batch, False)
        seconds, cpu, result = self._loop.run_until_complete(self._timed(self.tier.store, job))
        if not result.success:
            raise RuntimeError(f"kvtier's store of batch {batch} failed")
        return seconds, cpu

    def load_batch(self, batch: int, payloads: Payloads) -> tuple[float, float, int]:
        self._rows[:] = 0
        job = self._job(batch, True)
        seconds, cpu, result = self._loop.run_until_complete(self._timed(self.tier.load, job))
        loaded = set(job.keys if result.successful_keys is None else result.successful_keys)
        wrong = sum(
            key not in loaded
            or not numpy.array_equal(self._rows[i], payloads[batch * self._keys + i])
            for i, key in enumerate(job.keys)
        )
        return seconds, cpu, wrong

    def integrity_failures(self) -> int:
        return self.ctx.counters.integrity_failures

    def close(self) -> None:
        self._loop.run_until_complete(self.tier.aclose())
        self._loop.close()
        del self._rows
        self.region.close()


def open_side(name: str, directory: Path, object_bytes: int, keys: int, odirect: bool) -> Side:
    directory.mkdir(parents=True)
    if name == "kvtier":
        return KVTierSide(directory, object_bytes, keys, odirect)
    return LMCacheSide(name.removeprefix("lmcache_"), directory, object_bytes, keys, odirect)


def run_side(
    name: str, directory: Path, payloads: Payloads, args: argparse.Namespace, odirect: bool
) -> SideRun:
    side = open_side(name, directory, payloads.object_bytes, args.keys, odirect)
    run = SideRun(o_direct=side.o_direct)
    batch_bytes = args.keys * payloads.object_bytes
    try:
        for batch in range(args.batches + 1):
            seconds, cpu = side.store_batch(batch, payloads)
            if batch:
                run.store.add(seconds, cpu, batch_bytes)
        if args.corrupt:
            corrupt_files(directory, args.corrupt, payloads.object_bytes)
        evict(directory)
        for batch in range(args.batches + 1):
            seconds, cpu, wrong = side.load_batch(batch, payloads)
            run.mismatches += wrong
            if batch:
                run.load.add(seconds, cpu, batch_bytes)
        run.integrity_failures = side.integrity_failures()
    finally:
        side.close()
    return run


# --------------------------------------------------------------- the figures


def side_figures(runs: list[SideRun]) -> dict[str, float]:
    def median(fn: Callable[[SideRun], float]) -> float:
        return statistics.median(fn(run) for run in runs)

    stores = [s for run in runs for s in run.store.batch_s]
    loads = [s for run in runs for s in run.load.batch_s]
    return {
        "store_gbps": median(lambda r: r.store.gbps()),
        "load_gbps": median(lambda r: r.load.gbps()),
        "store_cpu_s_per_gib": median(lambda r: r.store.cpu_per_gib()),
        "load_cpu_s_per_gib": median(lambda r: r.load.cpu_per_gib()),
        "store_p50_ms": percentile(stores, 0.5) * 1e3,
        "store_p99_ms": percentile(stores, 0.99) * 1e3,
        "load_p50_ms": percentile(loads, 0.5) * 1e3,
        "load_p99_ms": percentile(loads, 0.99) * 1e3,
        "mismatches": sum(run.mismatches for run in runs),
        "integrity_failures": sum(run.integrity_failures for run in runs),
        "o_direct": all(run.o_direct for run in runs),
    }


def compare(figures: dict[str, dict[str, float]]) -> tuple[dict[str, float], list[str]]:
    """kvtier over the best LMCache adapter for each figure; the figures where kvtier
    is not ahead of both."""
    ratios: dict[str, float] = {}
    behind: list[str] = []
    for name, (_, _, more_is_better) in FIGURES.items():
        theirs = [figures[side][name] for side in LMCACHE_SIDES]
        best = max(theirs) if more_is_better else min(theirs)
        ours = figures["kvtier"][name]
        ratios[name] = ours / best if best else float("inf")
        if (ours <= best) if more_is_better else (ours >= best):
            behind.append(name)
    return ratios, behind


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {
        "runs": args.runs,
        "batches": args.batches,
        "keys_per_batch": args.keys,
        "corrupted_per_side": args.corrupt,
        "page_cache": "fadvise",
    }
    behind_all: list[str] = []
    for size in args.sizes:
        object_bytes = int(size * MIB)
        payloads = Payloads(object_bytes, (args.batches + 1) * args.keys)
        for mode in args.modes:
            line = f"{size:g}MiB_{mode}"
            group = root / line
            runs: dict[str, list[SideRun]] = {side: [] for side in args.sides}
            for index in range(args.runs):
                for side in args.sides:
                    directory = group / f"run{index}-{side}"
                    runs[side].append(run_side(side, directory, payloads, args, mode == "odirect"))
            shutil.rmtree(group, ignore_errors=True)
            figures = {side: side_figures(side_runs) for side, side_runs in runs.items()}
            for side, values in figures.items():
                out.update({f"{line}_{side}_{name}": value for name, value in values.items()})
            ratios: dict[str, float] = {}
            if set(SIDES) <= figures.keys():
                ratios, behind = compare(figures)
                out.update({f"{line}_ratio_{name}": value for name, value in ratios.items()})
                behind_all += [f"{line}_{name}" for name in behind]
            print_table(line, figures, ratios)
    if set(SIDES) <= set(args.sides):
        out["kvtier_ahead"] = not behind_all
        out["kvtier_behind"] = behind_all
    return out


COLUMNS = {"lmcache_fs": "LMCache fs", "lmcache_fs_native": "LMCache fs_native", "kvtier": "kvtier"}


def print_table(line: str, figures: dict[str, dict[str, float]], ratios: dict[str, float]) -> None:
    size, mode = line.split("_")
    if mode == "odirect":
        label = "O_DIRECT"
        if "kvtier" in figures:
            found = figures["kvtier"]["o_direct"]
            label += f" (kvtier at its defaults: {'O_DIRECT' if found else 'refused, buffered'})"
    else:
        label = 'page cache (LMCache "use_odirect": false, kvtier "o_direct": false)'
    print(f"\n{size} objects, {label}")
    sides = list(figures)
    widths = [max(10, len(COLUMNS[side]) + 2) for side in sides]

    def row(label_text: str, cells: list[str], tail: str = "") -> None:
        text = "".join(f"{cell:>{width}}" for cell, width in zip(cells, widths, strict=True))
        print(f"  {label_text:<20}{text}{tail}")

    row("", [COLUMNS[side] for side in sides], "   kvtier / best LMCache" if ratios else "")
    for name, (label_text, fmt, more_is_better) in FIGURES.items():
        better = "higher" if more_is_better else "lower"
        tail = f"   {ratios[name]:.2f} ({better} is better)" if ratios else ""
        row(label_text, [fmt.format(figures[side][name]) for side in sides], tail)
    row("mismatches", [str(int(figures[side]["mismatches"])) for side in sides])
    row(
        "integrity failures",
        [str(int(figures[s]["integrity_failures"])) if s == "kvtier" else "-" for s in sides],
    )


def report(figures: dict[str, Any]) -> str:
    text = json.dumps(
        {
            name: round(value, 4) if isinstance(value, float) else value
            for name, value in figures.items()
        }
    )
    print(text)
    return text


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="kvtier-vs_lmcache-", dir=args.root))
    try:
        text = report(run(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
