"""GPU <-> primary copy bandwidth against a plain pinned copy of the same bytes.

Stores and loads jobs of ``--chunks-per-job`` chunks through ``OffloadingWorker`` (the
CUDA engine on a GPU, the CPU engine elsewhere) and, in the same run, copies the same
number of bytes with one ``copy_`` between a device tensor and a pinned host tensor:
the bandwidth the hardware gives a single large DMA. Each direction is timed twice: one
job at a time, each awaited before the next (a job's whole latency), and
``--in-flight`` jobs at a time, as an engine keeps its stores and loads going (the
throughput). Prints a table, then one JSON line with ``store_gbps``, ``load_gbps``
(one at a time), ``store_in_flight_gbps``, ``load_in_flight_gbps``, ``raw_d2h_gbps``,
``raw_h2d_gbps`` and the ratios.

    python benchmarks/gpu_copy.py                   # defaults: 32 layers x K/V, 2 MiB chunks
    python benchmarks/gpu_copy.py --layers 8 --jobs 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

import torch

from kvtier import OffloadingConfig, OffloadingSpecFactory


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument(
        "--block-kib", type=int, default=32, help="KiB per K or V tensor per GPU block"
    )
    parser.add_argument("--gpu-blocks", type=int, default=1024)
    parser.add_argument("--chunks-per-job", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument(
        "--in-flight", type=int, default=8, help="jobs at a time in the throughput pass"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw_bandwidth(nbytes: int, device: torch.device, repeats: int) -> tuple[float, float]:
    """GB/s of device->host and host->device ``copy_`` calls of ``nbytes`` each.

    The copies rotate over eight distinct slices so that, on a CPU, they measure
    memory and not a cache-resident buffer.
    """
    pin = device.type == "cuda"
    lanes = 8
    host = torch.empty((lanes, nbytes), dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty((lanes, nbytes), dtype=torch.uint8, device=device)
    dev.fill_(1)
    host.fill_(2)
    results = []
    for dst, src in ((host, dev), (dev, host)):
        dst[0].copy_(src[0], non_blocking=pin)
        sync(device)
        start = time.perf_counter()
        for i in range(repeats):
            dst[i % lanes].copy_(src[(i + 3) % lanes], non_blocking=pin)
        sync(device)
        results.append(nbytes * repeats / (time.perf_counter() - start) / 1e9)
    return results[0], results[1]


async def run(args: argparse.Namespace) -> dict[str, float]:
    device = torch.device(args.device)
    block_bytes = args.block_kib * 1024
    kv = [
        torch.randint(0, 255, (args.gpu_blocks, block_bytes), dtype=torch.uint8, device=device)
        for _ in range(2 * args.layers)
    ]
    kv_bytes_per_block = block_bytes * len(kv)
    chunks = args.chunks_per_job
    num_chunks = max(4 * chunks, args.in_flight * chunks, 64)
    config = OffloadingConfig(
        engine_id=f"bench-gpu-{uuid.uuid4().hex[:8]}",
        kv_bytes_per_block=kv_bytes_per_block,
        extra_config={"cpu_bytes_to_use": num_chunks * kv_bytes_per_block},
    )
    spec = OffloadingSpecFactory.create_spec(config)
    spec.get_manager()
    worker = spec.create_worker(kv)
    # 1.0: one gather kernel per job (the CUDA engine where Triton runs), else 0.0.
    gather_kernel = float(getattr(worker.engine, "gather_kernel", False))
    job_bytes = chunks * kv_bytes_per_block

    def copy(direction: str, job: int) -> Any:
        slots = [(job * chunks + i) % num_chunks for i in range(chunks)]
        blocks = [(job * chunks + i) % args.gpu_blocks for i in range(chunks)]
        if direction == "store":
            return worker.store(blocks, slots)
        return worker.load(slots, blocks)

    try:
        timings = {}
        for direction in ("store", "load"):
            # One warm-up job, then the timed ones.
            elapsed = 0.0
            for job in range(args.jobs + 1):
                start = time.perf_counter()
                result = await copy(direction, job)
                if job:
                    elapsed += time.perf_counter() - start
                assert result.success
            timings[direction] = job_bytes * args.jobs / elapsed / 1e9
            # Then --in-flight jobs at a time, on slots and blocks apart from each other.
            rounds = max(1, args.jobs // args.in_flight)
            start = time.perf_counter()
            for batch in range(rounds):
                first = batch * args.in_flight
                jobs = [copy(direction, first + i) for i in range(args.in_flight)]
                assert all(result.success for result in await asyncio.gather(*jobs))
            elapsed = time.perf_counter() - start
            moved = job_bytes * args.in_flight * rounds
            timings[f"{direction}_in_flight"] = moved / elapsed / 1e9
        raw_d2h, raw_h2d = raw_bandwidth(job_bytes, device, args.jobs)
    finally:
        await worker.aclose()
        await spec.aclose()
    return {
        "device": 0.0 if device.type == "cpu" else 1.0,
        "gather_kernel": gather_kernel,
        "job_mib": job_bytes / 2**20,
        "store_gbps": timings["store"],
        "load_gbps": timings["load"],
        "raw_d2h_gbps": raw_d2h,
        "raw_h2d_gbps": raw_h2d,
        "store_ratio": timings["store"] / raw_d2h,
        "load_ratio": timings["load"] / raw_h2d,
        "in_flight": float(args.in_flight),
        "store_in_flight_gbps": timings["store_in_flight"],
        "load_in_flight_gbps": timings["load_in_flight"],
        "store_in_flight_ratio": timings["store_in_flight"] / raw_d2h,
        "load_in_flight_ratio": timings["load_in_flight"] / raw_h2d,
    }


def main() -> None:
    args = parse_args()
    figures = asyncio.run(run(args))
    job_mib = figures["job_mib"]
    gather = "one gather kernel per job" if figures["gather_kernel"] else "an operator per tensor"
    print(
        f"device {args.device}: {2 * args.layers} KV tensors, jobs of {job_mib:.0f} MiB, {gather}"
    )
    in_flight = int(figures["in_flight"])
    for name in ("store", "load"):
        raw = "raw_d2h_gbps" if name == "store" else "raw_h2d_gbps"
        print(
            f"  {name:5s} {figures[f'{name}_gbps']:7.2f} GB/s one at a time, "
            f"{figures[f'{name}_in_flight_gbps']:7.2f} GB/s {in_flight} in flight   "
            f"raw copy_ {figures[raw]:7.2f} GB/s   ratios "
            f"{figures[f'{name}_ratio']:.2f} / {figures[f'{name}_in_flight_ratio']:.2f}"
        )
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else args.device
    print(json.dumps({"device_name": name, **figures}))


if __name__ == "__main__":
    main()
