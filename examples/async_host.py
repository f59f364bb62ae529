"""A minimal async serving host that offloads its KV cache through KVTier.

Requests share a system prompt. Each request looks up its chunks, loads the hits into
its GPU blocks, "computes" the rest and stores them. The primary tier holds only 32
chunks, so when users come back for a second round their own chunks have left CPU
memory, and are promoted back from disk (the fs tier). Run it with::

    python examples/async_host.py [ROOT_DIR]

With ROOT_DIR the fs tier stays there after the run, for ``kvtier inspect ROOT_DIR``;
without, it lives in a temporary directory removed at the end.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import tempfile
import uuid

import torch

from kvtier import KVTier, OffloadingConfig, make_offload_key

TOKENS_PER_BLOCK = 16
LAYERS = 4
BLOCK_BYTES = 8 * 1024  # per layer per GPU block
GPU_BLOCKS = 256


def chunk_keys(prompt: list[int]) -> list[bytes]:
    """Chained block hashes, as a serving engine computes them for prefix caching."""
    keys, parent = [], b""
    for start in range(0, len(prompt) - len(prompt) % TOKENS_PER_BLOCK, TOKENS_PER_BLOCK):
        tokens = prompt[start : start + TOKENS_PER_BLOCK]
        parent = hashlib.sha256(parent + bytes(str(tokens), "ascii")).digest()
        keys.append(make_offload_key(parent))
    return keys


async def serve(kv: KVTier, kv_caches: list[torch.Tensor], req_id: str, prompt: list[int]) -> int:
    keys = chunk_keys(prompt)
    blocks = list(range(len(keys)))  # a real engine takes these from its block pool
    hits = await kv.lookup(keys, req_id, timeout=1.0)
    loaded = await kv.load(keys[:hits], blocks[:hits], req_id)
    for block in blocks[loaded:]:  # "prefill" the chunks that were not cached
        for layer in kv_caches:
            layer[block].fill_(hash((req_id, block)) % 251)
    await kv.store(keys, blocks, req_id)
    kv.finish(req_id)
    return loaded


async def main(root_dir: str) -> None:
    config = OffloadingConfig(
        engine_id=f"example-{uuid.uuid4().hex[:8]}",
        kv_bytes_per_block=LAYERS * BLOCK_BYTES,
        tokens_per_block=TOKENS_PER_BLOCK,
        model_name="example-model",
        kv_dtype="uint8",  # the tensors' dtype: part of the namespace the chunks belong to
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 32 * LAYERS * BLOCK_BYTES,  # only 32 chunks in RAM
            "secondary_tiers": [{"type": "fs", "root_dir": root_dir}],
        },
    )
    kv_caches = [torch.zeros((GPU_BLOCKS, BLOCK_BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    system_prompt = list(range(8 * TOKENS_PER_BLOCK))
    async with KVTier(config, kv_caches) as kv:
        for round_ in (1, 2):
            for user in range(8):
                prompt = system_prompt + [1000 + user] * (8 * TOKENS_PER_BLOCK)
                loaded = await serve(kv, kv_caches, f"user-{user}-{round_}", prompt)
                print(f"round {round_} user {user}: {loaded} of 16 chunks cached")
            await kv.drain()
        stats = kv.manager.diagnostics.tier_stats()
        print(
            f"fs tier: {stats['1:fs']['hits']:.0f} chunk hits, "
            f"{stats['1:fs']['bytes_written'] / 2**20:.1f} MiB written"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        asyncio.run(main(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as directory:
            asyncio.run(main(directory))
