"""GPU <-> primary copy bandwidth against a plain pinned copy of the same bytes.

Stores and loads jobs of ``--chunks-per-job`` chunks through ``OffloadingWorker`` (the
CUDA engine on a GPU, the CPU engine elsewhere) and, in the same run, copies the same
number of bytes with one ``copy_`` between a device tensor and a pinned host tensor:
the bandwidth the hardware gives a single large DMA. Prints a table, then one JSON
line with ``store_gbps``, ``load_gbps``, ``raw_d2h_gbps``, ``raw_h2d_gbps`` and the
ratios.

    python benchmarks/gpu_copy.py                   # defaults: 32 layers x K/V, 2 MiB chunks
    python benchmarks/gpu_copy.py --layers 8 --jobs 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

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
    num_chunks = max(4 * chunks, 64)
    config = OffloadingConfig(
        engine_id=f"bench-gpu-{uuid.uuid4().hex[:8]}",
        kv_bytes_per_block=kv_bytes_per_block,
        extra_config={"cpu_bytes_to_use": num_chunks * kv_bytes_per_block},
    )
    spec = OffloadingSpecFactory.create_spec(config)
    spec.get_manager()
    worker = spec.create_worker(kv)
    job_bytes = chunks * kv_bytes_per_block
    try:
        timings = {}
        for direction in ("store", "load"):
            # One warm-up job, then the timed ones.
            elapsed = 0.0
            for job in range(args.jobs + 1):
                slots = [(job * chunks + i) % num_chunks for i in range(chunks)]
                blocks = [(job * chunks + i) % args.gpu_blocks for i in range(chunks)]
                start = time.perf_counter()
                if direction == "store":
                    result = await worker.store(blocks, slots)
                else:
                    result = await worker.load(slots, blocks)
                if job:
                    elapsed += time.perf_counter() - start
                assert result.success
            timings[direction] = job_bytes * args.jobs / elapsed / 1e9
        raw_d2h, raw_h2d = raw_bandwidth(job_bytes, device, args.jobs)
    finally:
        await worker.aclose()
        await spec.aclose()
    return {
        "device": 0.0 if device.type == "cpu" else 1.0,
        "job_mib": job_bytes / 2**20,
        "store_gbps": timings["store"],
        "load_gbps": timings["load"],
        "raw_d2h_gbps": raw_d2h,
        "raw_h2d_gbps": raw_h2d,
        "store_ratio": timings["store"] / raw_d2h,
        "load_ratio": timings["load"] / raw_h2d,
    }


def main() -> None:
    args = parse_args()
    figures = asyncio.run(run(args))
    job_mib = figures["job_mib"]
    print(f"device {args.device}: {2 * args.layers} KV tensors, jobs of {job_mib:.0f} MiB")
    for name in ("store", "load"):
        raw = "raw_d2h_gbps" if name == "store" else "raw_h2d_gbps"
        print(
            f"  {name:5s} {figures[f'{name}_gbps']:7.2f} GB/s   raw copy_ {figures[raw]:7.2f} GB/s"
            f"   ratio {figures[f'{name}_ratio']:.2f}"
        )
    print(json.dumps({"device_name": args.device, **figures}))


if __name__ == "__main__":
    main()
