"""A configuration written for vLLM 0.33's own TieringOffloadingSpec, every key it reads
set, runs on kvtier once spec_name and spec_module_path name kvtier's adapter: built by
vLLM's factory, and served back through vLLM's scheduler from the tiers it describes."""

from __future__ import annotations

import asyncio
import random

import vllm_offline
from s3_servers import ACCESS_KEY, SECRET_KEY, raw_client
from vllm.v1.kv_offload import base as vllm_base
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm_keys import vllm_tiering_config
from vllm_procs import TOKENS_PER_BLOCK

from kvtier.integrations.vllm import KVTierOffloadingSpec

PRIMARY_BYTES = 256 * 2 * 2048  # 256 GPU blocks of both layers of the tiny model


def test_vllms_factory_builds_kvtier_from_every_vllm_tiering_key(engine_id, tmp_path):
    extra = vllm_tiering_config(str(tmp_path / "fs"))
    config = vllm_offline.offloading_config(engine_id, extra, worker_kv_bytes_per_block=4096)
    spec = OffloadingSpecFactory.create_spec(config)
    assert isinstance(spec, KVTierOffloadingSpec)
    settings = spec.kvtier_spec.settings
    fs, obj = settings.tiers
    assert (fs.settings.read_depth, fs.settings.capacity_bytes) == (4, 1 << 30)
    assert (fs.backpressure.policy, fs.backpressure.failure_threshold) == ("drop", 2)
    assert obj.settings.endpoint_url == "http://127.0.0.1:9000"
    assert (obj.settings.prefix, obj.settings.max_concurrency) == ("vllm/kv", 8)
    assert (obj.locality, obj.events, obj.backpressure.high_water) == ("remote", False, 0.05)
    assert settings.max_tracked_lookups == 32_000
    # vLLM's API server declares the metrics from the configuration alone.
    definitions = KVTierOffloadingSpec.build_metric_definitions(extra)
    assert all(isinstance(d, vllm_base.OffloadingMetricMetadata) for d in definitions.values())


def prompt(seed: int, num_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(num_blocks * TOKENS_PER_BLOCK)]


def object_names(endpoint: str, bucket: str) -> list[str]:
    async def names() -> list[str]:
        async with raw_client(endpoint) as client:
            listed = await client.list_objects_v2(Bucket=bucket)
            return [item["Key"] for item in listed.get("Contents", [])]

    return asyncio.run(names())


def test_a_vllm_obj_tier_stores_to_and_serves_back_from_an_s3_server(make_engine, moto, bucket):
    extra = vllm_tiering_config(
        "/unused",
        endpoint=moto.endpoint.removeprefix("http://"),
        bucket=bucket,
        access_key=ACCESS_KEY,
        secret_key=SECRET_KEY,
        cpu_bytes_to_use=PRIMARY_BYTES,
    )
    extra["secondary_tiers"] = [extra["secondary_tiers"][1]]  # the obj tier alone
    engine = make_engine(extra)
    shared = prompt(11, 8)
    engine.add("first", [*shared, 5])
    engine.run()
    engine.drain_tiers()
    names = object_names(moto.endpoint, bucket)
    assert len(names) >= 8 and all(name.startswith("vllm/kv/") for name in names)
    engine.scheduler.reset_prefix_cache(reset_connector=True)  # the primary tier too
    engine.wipe_gpu()
    engine.add("second", [*shared, 6])
    engine.run()
    # Every block of the prompt came back from the bucket, each token's bytes checked.
    assert engine.cached_at_start["second"] == 8 * TOKENS_PER_BLOCK
    assert engine.verified_blocks >= 8
