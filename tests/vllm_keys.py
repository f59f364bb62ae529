"""A configuration written for vLLM 0.33's ``TieringOffloadingSpec`` that sets every key
it and its built-in tiers read, with ``spec_name`` and ``spec_module_path`` naming
kvtier's adapter instead: what a vLLM operator runs after changing those two lines."""

from __future__ import annotations

from typing import Any

ADAPTER = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm"}


def vllm_tiering_config(
    root_dir: str,
    *,
    endpoint: str = "127.0.0.1:9000",
    bucket: str = "kv-cache",
    access_key: str = "AKIDVLLMKEYS",
    secret_key: str = "vllm-secret-key-never-shown",
    cpu_bytes_to_use: int = 1 << 24,
) -> dict[str, Any]:
    """vLLM's ``kv_connector_extra_config`` with an fs tier on ``root_dir`` and an obj
    tier on the S3 server at ``endpoint`` (``host:port``, plain http): every top-level,
    back-pressure, fs and obj key of vLLM 0.33 set."""
    return {
        **ADAPTER,
        "cpu_bytes_to_use": cpu_bytes_to_use,
        "blocks_per_chunk": 1,
        "eviction_policy": "lru",
        "offload_prompt_only": True,
        "store_threshold": 0,
        "max_tracker_size": 32_000,
        "tier_poll_interval_s": 0.001,
        "self_describing_kv_events": False,
        "sync_load_budget_bytes": 0,
        "backpressure": {
            "backpressure_cls": "EMABackpressureDetector",
            "policy_cls": "vllm.v1.kv_offload.tiering.backpressure.ThrottledDropPolicy",
            "alpha": 0.2,
            "decay_half_life_s": 2.0,
            "cooldown_s": 1.0,
        },
        "secondary_tiers": [
            {
                "type": "fs",
                "root_dir": root_dir,
                "n_read_threads": 4,
                "n_write_threads": 4,
                "max_bytes": 1 << 30,
                "enable_kv_events": True,
                "locality": "LOCAL",
                "backpressure": {
                    "policy_cls": "DropStorePolicy",
                    "high_water_s": 0.02,
                    "low_water_s": 0.004,
                    "warmup_completions": 5,
                    "failure_threshold": 2,
                },
            },
            {
                "type": "obj",
                "store_config": {
                    "bucket": bucket,
                    "endpoint_override": endpoint,
                    "scheme": "http",
                    "access_key": access_key,
                    "secret_key": secret_key,
                    "session_token": "",
                    "region": "us-east-1",
                    "ca_bundle": "",
                },
                "prefix": "vllm/kv",
                "io_threads": 8,
                "enable_kv_events": False,
                "locality": "REMOTE",
                "backpressure": {},
            },
        ],
    }
