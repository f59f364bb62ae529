"""What a chunk file's store costs the CPU: vLLM's C writer and kvtier's system calls,
with and without the checksum, at one thread and at many.

kvtier's fs tier stores a chunk with ``open`` (``O_CREAT | O_EXCL | O_DIRECT``),
``pwritev`` of its header and payload, ``close`` and ``rename``, from Python threads,
and takes the payload's checksum just before. vLLM 0.33's fs tier makes the same calls
(``write`` instead of ``pwritev``, no header) from its C extension ``vllm.fs_io_C``,
one GIL release per batch. This benchmark writes the same chunks, from the rows of one
kvtier region (``SharedOffloadRegion``: shared memory, every page allocated and mapped
before any pass), into fresh directories on one disk, each way in turn:

* ``vllm_c``: ``vllm.fs_io_C.batch_store_block``, batches of 16 (where it imports);
* ``python``: kvtier's calls, the header packed with no checksum taken;
* ``python+checksum``: kvtier's calls with the checksum taken, as the fs tier does.

Each of ``--threads`` splits the chunks among that many threads. A run times each way
at each thread count once, in an order that rotates from run to run; the page cache is
not involved (``O_DIRECT``), and ``os.sync()`` runs before each pass. CPU is the whole
process's (``getrusage``) per GiB written, and its user and system parts (the kernel
splits the total between them by sampling, so over a short pass only the total is
exact). Beside them, the checksum pass alone, in this thread: over anonymous memory no
cache holds (``measure_checksum``, the allowance's term in ``vs_vllm.py``) and over the
region's own rows, every row once, after the passes.

The last line is one JSON object: ``figures[way][threads]`` holds the medians
(``user_s_per_gib``, ``sys_s_per_gib``, ``cpu_s_per_gib``, ``gbps``).

    python benchmarks/store_syscalls.py --root /path/on/the/disk --runs 3
    python benchmarks/store_syscalls.py --quick      # a few seconds
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvtier import make_offload_key
from kvtier.bench import physical
from kvtier.format import HEADER_BYTES, ChunkFormat
from kvtier.region import SharedOffloadRegion

#: Chunks per call of vLLM's batch writer: one request's blocks, as its tier batches them.
VLLM_BATCH = 16

Writer = Callable[[str, list[int]], None]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=None, help="directory on the disk to test")
    parser.add_argument("--gib", type=float, default=1.0, help="GiB written per pass")
    parser.add_argument("--chunk-mib", type=float, default=2.0)
    parser.add_argument(
        "--threads",
        type=thread_counts,
        default=None,
        help="thread counts, comma-separated (default 1,16; 1,4 with --quick)",
    )
    parser.add_argument("--runs", type=int, default=3, help="passes of each way, alternating")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--quick", action="store_true", help="small sizes, one run (a smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.gib, args.runs = 1 / 32, 1
    if args.threads is None:
        args.threads = [1, 4] if args.quick else [1, 16]
    args.chunk_bytes = int(args.chunk_mib * (1 << 20))
    if args.chunk_bytes <= 0 or args.chunk_bytes % mmap.PAGESIZE:
        parser.error(f"--chunk-mib: {args.chunk_mib} MiB is not a whole number of pages")
    if args.gib <= 0 or args.runs < 1:
        parser.error(f"--gib {args.gib} and --runs {args.runs}: both must be above 0")
    args.chunks = max(1, int(args.gib * (1 << 30)) // args.chunk_bytes)
    return args


def thread_counts(text: str) -> list[int]:
    """``--threads``: positive whole numbers, comma-separated."""
    counts = []
    for part in text.split(","):
        if not part.strip().isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(f"{part!r} is not a thread count (1 or more)")
        counts.append(int(part))
    return counts


def filled_region(chunks: int, chunk_bytes: int) -> SharedOffloadRegion:
    """A kvtier region of ``chunks`` rows, each holding distinct bytes."""
    region = SharedOffloadRegion(
        f"bench-syscalls-{uuid.uuid4().hex[:8]}",
        num_chunks=chunks,
        chunk_bytes=chunk_bytes,
        column_bytes=chunk_bytes,
        world_size=1,
        rank=None,
    )
    for slot in range(chunks):
        region.primary_view[slot][:] = random.randbytes(4096) * (chunk_bytes // 4096)
    return region


def python_writer(rows: list[memoryview], checksum: bool) -> Writer:
    """kvtier's fs tier's calls for each chunk; the checksum taken or not."""
    layout = ChunkFormat("bench")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DIRECT

    def write(directory: str, indices: list[int]) -> None:
        with mmap.mmap(-1, HEADER_BYTES) as page, memoryview(page) as header:
            for index in indices:
                row, final = rows[index], f"{directory}/{index}"
                key = make_offload_key(index.to_bytes(16, "big"), 0)
                layout.pack_header(header, key, row, None if checksum else 0)
                fd = os.open(f"{final}.tmp", flags, 0o644)
                try:
                    if os.pwritev(fd, [header, row], 0) != HEADER_BYTES + len(row):
                        raise OSError(f"short write of {final}")
                finally:
                    os.close(fd)
                os.rename(f"{final}.tmp", final)

    return write


def vllm_writer(rows: list[memoryview]) -> Writer | str:
    """vLLM's C batch writer over ``rows``, or why it is not here."""
    try:
        from vs_vllm import load_fs_io_extension
    except ImportError as exc:
        return f"not measured: vLLM does not import here ({exc})"
    loaded = load_fs_io_extension()
    try:
        from vllm.fs_io_C import batch_store_block
    except ImportError:
        return f"not measured: vllm.fs_io_C {loaded}"

    def write(directory: str, indices: list[int]) -> None:
        for start in range(0, len(indices), VLLM_BATCH):
            batch = indices[start : start + VLLM_BATCH]
            finals = [f"{directory}/{index}" for index in batch]
            batch_store_block(
                [f"{final}.tmp" for final in finals], finals, [rows[i] for i in batch], True
            )

    return write


def process_cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def one_pass(write: Writer, directory: Path, chunks: int, threads: int) -> dict[str, float]:
    """``chunks`` files written into ``directory`` by ``threads`` threads: CPU and rate."""
    directory.mkdir()
    shares = [list(range(start, chunks, threads)) for start in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: None, range(threads)))  # the threads exist before the clock
        os.sync()
        user, system = process_cpu()
        started = time.perf_counter()
        list(pool.map(write, [str(directory)] * threads, shares))
        seconds = time.perf_counter() - started
        user_after, system_after = process_cpu()
    shutil.rmtree(directory)
    return {"user_s": user_after - user, "sys_s": system_after - system, "seconds": seconds}


def medians(passes: list[dict[str, float]], nbytes: int) -> dict[str, float]:
    gib = nbytes / (1 << 30)

    def median(of: Callable[[dict[str, float]], float], digits: int = 4) -> float:
        return round(statistics.median(of(p) for p in passes), digits)

    return {
        "user_s_per_gib": median(lambda p: p["user_s"] / gib),
        "sys_s_per_gib": median(lambda p: p["sys_s"] / gib),
        "cpu_s_per_gib": median(lambda p: (p["user_s"] + p["sys_s"]) / gib),
        "gbps": median(lambda p: nbytes / p["seconds"] / 1e9, 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    region = filled_region(args.chunks, args.chunk_bytes)
    rows = [region.primary_view[slot] for slot in range(args.chunks)]
    root = Path(tempfile.mkdtemp(prefix="kvtier-syscalls-", dir=args.root))
    try:
        ways: dict[str, Writer] = {}
        vllm = vllm_writer(rows)
        notes = {}
        if isinstance(vllm, str):
            notes["vllm_c"] = vllm
        else:
            ways["vllm_c"] = vllm
        ways["python"] = python_writer(rows, checksum=False)
        ways["python+checksum"] = python_writer(rows, checksum=True)
        cells = [(way, threads) for way in ways for threads in args.threads]
        passes: dict[tuple[str, int], list[dict[str, float]]] = {cell: [] for cell in cells}
        for run in range(args.runs):
            for way, threads in cells[run % len(cells) :] + cells[: run % len(cells)]:
                directory = root / f"{way}-{threads}-{run}"
                passes[way, threads].append(one_pass(ways[way], directory, args.chunks, threads))
        nbytes = args.chunks * args.chunk_bytes
        figures: dict[str, Any] = {
            way: {str(threads): medians(passes[way, threads], nbytes) for threads in args.threads}
            for way in ways
        }
        checksum = physical.measure_checksum(args.chunk_bytes, nbytes=min(nbytes, 1 << 30))
        region_checksum = physical.time_checksums(rows, len(rows))
    finally:
        for row in rows:
            row.release()
        region.close()
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"store system calls: {args.chunks} chunks of {args.chunk_bytes / (1 << 20):g} MiB a pass, "
        f"O_DIRECT, into {root.parent}; medians of {args.runs} alternating passes"
    )
    columns = ("user_s_per_gib", "sys_s_per_gib", "cpu_s_per_gib", "gbps")
    print(f"  {'way':18s}{'threads':>8s}" + "".join(f"{name:>16s}" for name in columns))
    for way, by_threads in figures.items():
        for threads, cell in by_threads.items():
            print(f"  {way:18s}{threads:>8s}" + "".join(f"{cell[name]:16.3f}" for name in columns))
    print(
        f"  the checksum pass alone: {checksum:.3f} CPU s per GiB over anonymous memory, "
        f"{region_checksum:.3f} over the region's rows"
    )
    for way, why in notes.items():
        print(f"  {way}: {why}")
    report = {
        "figures": figures,
        "checksum_cpu_s_per_gib": round(checksum, 4),
        "region_checksum_cpu_s_per_gib": round(region_checksum, 4),
        "not_measured": notes,
        "chunks": args.chunks,
        "chunk_bytes": args.chunk_bytes,
        "threads": args.threads,
        "runs": args.runs,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
