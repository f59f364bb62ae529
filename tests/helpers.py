"""Builders shared by the tests."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from kvtier import KVTier, OffloadingConfig, OffloadKey, make_offload_key


def make_config(
    engine_id: str, *, kv_bytes_per_block: int = 4096, **extra: Any
) -> OffloadingConfig:
    options: dict[str, Any] = {"cpu_bytes_to_use": 64 * kv_bytes_per_block}
    config_fields = {
        k: extra.pop(k)
        for k in (
            "tokens_per_block",
            "world_size",
            "rank",
            "model_name",
            "kv_dtype",
            "enable_kv_events",
            "layout",
            "canonical_format",
            "replicated",
        )
        if k in extra
    }
    options.update(extra)
    return OffloadingConfig(
        engine_id=engine_id,
        kv_bytes_per_block=kv_bytes_per_block,
        extra_config=options,
        **config_fields,
    )


def keys(prefix: str, count: int, group: int = 0) -> list[OffloadKey]:
    """``count`` distinct keys, the same for the same prefix."""
    return [make_offload_key(f"{prefix}-{i}".encode().ljust(16, b"."), group) for i in range(count)]


def tiering_config(
    engine_id: str,
    tiers: list[dict[str, Any]],
    *,
    chunks: int = 8,
    kv_bytes_per_block: int = 4096,
    **extra: Any,
) -> OffloadingConfig:
    """A TieringOffloadingSpec config with ``chunks`` primary slots."""
    return make_config(
        engine_id,
        kv_bytes_per_block=kv_bytes_per_block,
        spec_name="TieringOffloadingSpec",
        cpu_bytes_to_use=chunks * kv_bytes_per_block,
        secondary_tiers=tiers,
        **extra,
    )


def scripted(tag: str, **params: Any) -> dict[str, Any]:
    return {"type": "ScriptedTier", "module_path": "scripted_tier", "tag": tag, **params}


async def store_all(kv: KVTier, ks: list[OffloadKey], first_block: int = 0) -> None:
    """Store ``ks`` a primary-full at a time, so every key reaches the secondary tiers."""
    size = kv.num_chunks
    for i in range(0, len(ks), size):
        part = ks[i : i + size]
        blocks = list(range(first_block + i, first_block + i + len(part)))
        assert await kv.store(part, blocks, f"w{uuid.uuid4().hex}") == len(part)
        await kv.drain()


def damaged(data: bytes, how: str) -> bytes:
    """``data`` (a stored chunk: header page, then payload) damaged in one way.

    ``flip_payload`` and ``flip_header`` flip one bit; ``truncate`` drops the last
    1000 bytes; ``append`` adds bytes after the end.
    """
    out = bytearray(data)
    if how == "flip_payload":
        out[-100] ^= 0x01
    elif how == "flip_header":
        out[30] ^= 0x01
    elif how == "truncate":
        del out[-1000:]
    elif how == "append":
        out += b"extra"
    else:
        raise ValueError(f"unknown damage {how!r}")
    return bytes(out)


def wait_finished(worker: Any, count: int) -> list[Any]:
    """The results of ``count`` jobs a worker was given, polled from ``get_finished``."""
    results: list[Any] = []
    pause = threading.Event()
    for _ in range(3000):
        results += worker.get_finished()
        if len(results) >= count:
            return results
        pause.wait(0.01)
    raise AssertionError(f"only {len(results)} of {count} jobs finished")


#: The repository's benchmark scripts.
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_benchmark(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<script>`` run as a user runs it, with this interpreter: its exit
    code and its output."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
