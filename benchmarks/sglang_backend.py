"""kvtier against SGLang's own file backend, both driven by SGLang's real controller.

SGLang 0.5.23's ``HybridCacheController`` (the one its scheduler builds) over its real
host pool on the CPU (``benchmarks/sglang_host.py``), once with kvtier's backend
(``dynamic``, zero-copy interface, a primary tier and an fs tier) and once with
``HiCacheFile`` (``file``, SGLang's built-in), each in its own directory under the same
``--root``, moving the same pages, alternating backend by backend in every round (the
one that goes first changes each round). A round:

1. **store**: the pages are put in each host pool (untimed: the GPU's write-back), then
   backed up through the controller's backup thread one operation of 128 pages (one
   storage batch) at a time. "stored" stops the clock when SGLang has the last
   acknowledgement; "on disk" when the backend has nothing in flight any more (kvtier's
   cascades to the fs tier run after the call returns) and ``os.sync()`` returned.
2. **load, cold**: kvtier's primary tier emptied, ``os.sync()``, both directories dropped
   from the page cache; the same pages prefetched back through the controller's hit
   query, I/O and ack threads, one 128-page operation at a time. Every loaded page is
   compared with the bytes stored under its hash afterwards (untimed).
3. **load, warm**: the same prefetches again: kvtier serves them from its primary tier,
   ``HiCacheFile`` from the page cache.

Reported per backend and phase: pages/s and GB/s, each operation's latency p50 / p99
from the measured samples, and CPU seconds per GiB moved: of this process (all its
threads), and of the whole machine (every CPU's busy time, from ``/proc/stat``). The
second counts what the kernel does for a backend outside the process: a buffered
write's pages go to disk from the kernel's flusher threads, an O_DIRECT write's from
the writing thread itself. Run it on an otherwise idle machine. The last line is one
JSON object with every figure.

    .nox/sglang/bin/python benchmarks/sglang_backend.py --root /path/on/the/disk/to/measure
    .nox/sglang/bin/python benchmarks/sglang_backend.py --quick    # a few seconds

It needs SGLang as ``nox -s sglang`` installs it, with the session's torchvision
stand-in on the path: ``PYTHONPATH=tests/integrations/sglang/stubs``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import common
import torch
from sglang_host import Geometry, HiCacheHost, configure_process, kvtier_extra_config

from kvtier.bench.physical import drop_page_cache
from kvtier.hosts import Step, step_until_blocking

# SGLang's storage batch: the controller never hands a backend more pages at once.
BATCH_PAGES = 128
BACKENDS = ("kvtier", "file")
PHASES = ("stored", "on disk", "load cold", "load warm")


@dataclass
class Phase:
    """One backend's figures for one phase, summed over the rounds."""

    pages: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    machine_cpu_seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    wrong_pages: int = 0
    missing_pages: int = 0

    def add(
        self,
        pages: int,
        seconds: float,
        cpu: tuple[float, float],
        latencies: Sequence[float],
    ) -> None:
        """One measurement; ``cpu`` is (this process's, the machine's) CPU seconds."""
        self.pages += pages
        self.seconds += seconds
        self.cpu_seconds += cpu[0]
        self.machine_cpu_seconds += cpu[1]
        self.latencies.extend(latencies)

    def figures(self, page_bytes: int) -> dict[str, float]:
        nbytes = self.pages * page_bytes
        lat = sorted(self.latencies)
        return {
            "pages_per_s": self.pages / self.seconds if self.seconds else 0.0,
            "gbps": nbytes / self.seconds / 1e9 if self.seconds else 0.0,
            "batch_p50_ms": 1e3 * _percentile(lat, 50) if lat else 0.0,
            "batch_p99_ms": 1e3 * _percentile(lat, 99) if lat else 0.0,
            "cpu_s_per_gib": self.cpu_seconds / (nbytes / 2**30) if nbytes else 0.0,
            "machine_cpu_s_per_gib": (
                self.machine_cpu_seconds / (nbytes / 2**30) if nbytes else 0.0
            ),
            "wrong_pages": float(self.wrong_pages),
            "missing_pages": float(self.missing_pages),
        }


def cpu_now() -> tuple[float, float]:
    """CPU seconds so far: this process's (all threads), and the machine's busy time
    (user, nice, system, irq and softirq of every CPU; steal and idle left out)."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:8]
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields)
    busy = (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
    return time.process_time(), busy


def _since(before: tuple[float, float]) -> tuple[float, float]:
    now = cpu_now()
    return now[0] - before[0], now[1] - before[1]


def _percentile(sorted_values: list[float], q: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[int(q) - 1]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, help="directory on the disk to measure")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pages", type=int, default=1024, help="pages per round")
    parser.add_argument("--page-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=2, help="KV heads of this rank")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--cpu-bytes",
        type=int,
        default=1 << 30,
        help="kvtier's cpu_bytes_to_use (its primary tier; the rest of its settings "
        "are the defaults)",
    )
    parser.add_argument(
        "--tier-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a parameter of kvtier's fs tier (value as JSON, else a string), e.g. "
        "o_direct=false; without one, its defaults",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, two rounds")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.pages, args.page_tokens, args.layers = 2, 256, 16, 4
        args.cpu_bytes = 64 << 20
    if args.pages % BATCH_PAGES:
        parser.error(f"--pages must be a multiple of {BATCH_PAGES}")
    return args


class Bench:
    """The two hosts, their directories, and the figures."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.root = root
        self.geometry = Geometry(
            page_tokens=args.page_tokens,
            layers=args.layers,
            heads=args.heads,
            head_dim=args.head_dim,
            # Room for a round's pages stored and the same pages loaded back.
            host_tokens=2 * args.pages * args.page_tokens,
        )
        configure_process(args.page_tokens)
        self.dirs = {name: root / name for name in BACKENDS}
        kvtier = {
            "cpu_bytes_to_use": args.cpu_bytes,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": str(self.dirs["kvtier"]),
                    **common.tier_options(args.tier_option),
                }
            ],
        }
        self.hosts = {
            "kvtier": HiCacheHost("dynamic", kvtier_extra_config(kvtier), geometry=self.geometry),
            "file": HiCacheHost(
                "file", {"file_storage_path": str(self.dirs["file"])}, geometry=self.geometry
            ),
        }
        self.phases = {(b, p): Phase() for b in BACKENDS for p in PHASES}

    def close(self) -> None:
        for host in self.hosts.values():
            host.close()

    def round(self, number: int) -> None:
        order = BACKENDS if number % 2 == 0 else BACKENDS[::-1]
        page = self.geometry.page_tokens
        base = uuid.uuid4().int % 10**9 * 10**6
        ops = [
            [base + op * BATCH_PAGES * page + i for i in range(BATCH_PAGES * page)]
            for op in range(self.args.pages // BATCH_PAGES)
        ]
        stored_indices = {}
        for name in order:
            stored_indices[name] = self.store(name, ops)
        self.make_cold()
        for name in order:
            self.load(name, ops, "load cold")
        for name in order:
            self.load(name, ops, "load warm")
        for name in order:
            for indices in stored_indices[name]:
                self.hosts[name].free(indices)

    def store(self, name: str, ops: list[list[int]]) -> list[torch.Tensor]:
        host = self.hosts[name]
        indices = [host.fill(tokens) for tokens in ops]
        latencies = []
        cpu0, start = cpu_now(), time.perf_counter()
        for tokens, op_indices in zip(ops, indices, strict=True):
            began = time.perf_counter()
            stored = host.backup(tokens, op_indices)
            latencies.append(time.perf_counter() - began)
            if stored != len(tokens):
                self.phases[(name, "stored")].missing_pages += (len(tokens) - stored) // (
                    self.geometry.page_tokens
                )
        returned, cpu_returned = time.perf_counter(), _since(cpu0)
        self.settle(name)
        os.sync()
        on_disk, cpu_on_disk = time.perf_counter(), _since(cpu0)
        pages = len(ops) * BATCH_PAGES
        self.phases[(name, "stored")].add(pages, returned - start, cpu_returned, latencies)
        self.phases[(name, "on disk")].add(pages, on_disk - start, cpu_on_disk, [])
        return indices

    def settle(self, name: str) -> None:
        """Wait until the backend has nothing in flight (kvtier's cascades)."""
        if name != "kvtier":
            return
        manager = self.hosts[name].backend.page_store.manager

        def settled() -> Step:
            manager.on_schedule_end()
            return Step.WAIT if manager.has_pending_work() else Step.DONE

        step_until_blocking(manager.host, settled)

    def make_cold(self) -> None:
        self.hosts["kvtier"].backend.page_store.reset()
        os.sync()
        drop_page_cache([p for d in self.dirs.values() for p in d.rglob("*") if p.is_file()])

    def load(self, name: str, ops: list[list[int]], phase: str) -> None:
        host = self.hosts[name]
        page = self.geometry.page_tokens
        latencies = []
        results = []
        cpu0, start = cpu_now(), time.perf_counter()
        for tokens in ops:
            began = time.perf_counter()
            _, completed, indices = host.prefetch(tokens)
            latencies.append(time.perf_counter() - began)
            results.append((tokens, completed, indices))
        elapsed, cpu = time.perf_counter() - start, _since(cpu0)
        record = self.phases[(name, phase)]
        loaded = 0
        for tokens, completed, indices in results:
            done = completed // page
            loaded += done
            record.missing_pages += len(tokens) // page - done
            if indices is not None:
                hashes = host.hashes(tokens)[:done]
                record.wrong_pages += sum(not ok for ok in host.matching_pages(indices, hashes))
                host.free(indices)
        record.add(loaded, elapsed, cpu, latencies)

    def report(self) -> dict[str, Any]:
        page_bytes = self.geometry.page_bytes
        figures: dict[str, Any] = {
            "page_bytes": page_bytes,
            "page_tokens": self.geometry.page_tokens,
            "pages_per_round": self.args.pages,
            "rounds": self.args.rounds,
            "batch_pages": BATCH_PAGES,
            "kvtier_cpu_bytes_to_use": self.args.cpu_bytes,
        }
        for (name, phase), record in self.phases.items():
            key = f"{name}_{phase.replace(' ', '_')}"
            figures.update({f"{key}_{k}": v for k, v in record.figures(page_bytes).items()})
        return figures


def print_table(figures: dict[str, Any]) -> None:
    print(
        f"{figures['rounds']} rounds of {figures['pages_per_round']} pages of "
        f"{figures['page_bytes'] / 2**10:.0f} KiB ({figures['page_tokens']} tokens), "
        f"{BATCH_PAGES} pages per operation"
    )
    header = [
        "phase",
        "backend",
        "pages/s",
        "GB/s",
        "op p50 ms",
        "op p99 ms",
        "CPU s/GiB",
        "machine CPU s/GiB",
    ]
    print(" | ".join(header))
    for phase in PHASES:
        key = phase.replace(" ", "_")
        for name in BACKENDS:
            f = {k.removeprefix(f"{name}_{key}_"): v for k, v in figures.items()}
            print(
                f"{phase} | {name} | {f['pages_per_s']:.0f} | {f['gbps']:.2f} | "
                f"{f['batch_p50_ms']:.1f} | {f['batch_p99_ms']:.1f} | {f['cpu_s_per_gib']:.2f} | "
                f"{f['machine_cpu_s_per_gib']:.2f}"
            )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    scratch = None
    if args.root is None:
        scratch = Path(tempfile.mkdtemp(prefix="kvtier-sglang-"))
        root = scratch
    else:
        root = args.root / f"sglang-backend-{uuid.uuid4().hex[:8]}"
        root.mkdir(parents=True)
    torch.set_num_threads(1)
    try:
        bench = Bench(args, root)
        try:
            for number in range(args.rounds):
                bench.round(number)
        finally:
            bench.close()
        figures = bench.report()
    finally:
        shutil.rmtree(scratch or root, ignore_errors=True)
    print_table(figures)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))
    wrong = sum(v for k, v in figures.items() if k.endswith("wrong_pages"))
    if wrong:
        raise SystemExit(f"{wrong:.0f} loaded page(s) held other bytes than were stored")


if __name__ == "__main__":
    main()
