"""The spec against vLLM's own interfaces: its factory, metrics, results and events."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch
import vllm_offline
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics
from vllm.v1.kv_offload import base as vllm_base
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import kvtier
from kvtier.config import storage_namespace
from kvtier.integrations import vllm as integration
from kvtier.integrations.vllm import KVTierOffloadingSpec, KVTierSlots

SPEC = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm"}


def offloading_config(engine_id, extra, *, worker_kv_bytes_per_block=4096, **fields):
    return vllm_offline.offloading_config(
        engine_id, {**SPEC, **extra}, worker_kv_bytes_per_block=worker_kv_bytes_per_block, **fields
    )


def test_importing_kvtier_never_imports_vllm():
    code = "import sys, kvtier, kvtier.integrations; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_vllms_factory_loads_the_spec_through_spec_module_path(engine_id):
    assert OffloadingSpecFactory.get_spec_cls(SPEC) is KVTierOffloadingSpec
    spec = OffloadingSpecFactory.create_spec(
        offloading_config(engine_id, {"cpu_bytes_to_use": 1 << 20}, blocks_per_chunk=2)
    )
    assert isinstance(spec, vllm_base.OffloadingSpec)
    assert spec.kvtier_spec.block_size == 32
    manager = spec.get_manager()
    assert isinstance(manager, vllm_base.OffloadingManager)
    manager.shutdown()


def test_vllms_own_keys_are_accepted_and_fs_thread_counts_become_depths(engine_id, tmp_path):
    extra = {
        "cpu_bytes_to_use": 1 << 20,
        "blocks_per_chunk": 1,
        "self_describing_kv_events": True,
        "canonical_layout": False,
        "sync_load_budget_bytes": 1 << 20,
        "secondary_tiers": [
            {"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 3, "n_write_threads": 5}
        ],
    }
    spec = KVTierOffloadingSpec(offloading_config(engine_id, extra))
    [tier] = spec.kvtier_spec.settings.tiers
    assert (tier.settings.read_depth, tier.settings.write_depth) == (3, 5)
    assert "n_read_threads" not in tier.params


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {
                "secondary_tiers": [
                    {"type": "fs", "root_dir": "/x", "n_read_threads": 2, "read_depth": 2}
                ]
            },
            r"secondary_tiers\[0\].n_read_threads",
        ),
        ({"cpu_bytes_to_use": 1 << 20, "eviction_polcy": "lru"}, "did you mean 'eviction_policy'"),
    ],
)
def test_bad_settings_fail_at_start_naming_the_key(engine_id, extra, message):
    with pytest.raises(ValueError, match=message):
        KVTierOffloadingSpec(offloading_config(engine_id, {"cpu_bytes_to_use": 1 << 20, **extra}))


def test_kv_groups_are_part_of_the_storage_namespace(engine_id):
    def namespace(groups):
        spec = KVTierOffloadingSpec(
            offloading_config(engine_id, {"cpu_bytes_to_use": 1 << 20}, groups=groups)
        )
        return storage_namespace(spec.kvtier_config, spec.kvtier_spec.geometry)

    # One group: the namespace a model without groups always had.
    assert ";dtype=float16;" in namespace(1)
    # Two groups of one 16-token layer each: their chunks never mix with one group's.
    assert ";dtype=float16;groups=16x1,16x1;" in namespace(2)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"agnostic": False}, "vLLM does not certify this model's KV pages"),
        ({"kv_cache_layout": None}, "vLLM resolved no KV cache layout"),
    ],
)
def test_a_canonical_layout_vllm_would_not_certify_is_refused_at_start(engine_id, fields, message):
    config = offloading_config(
        engine_id, {"cpu_bytes_to_use": 1 << 20}, canonical_layout=True, **fields
    )
    with pytest.raises(ValueError, match=f"canonical_layout: {message}"):
        KVTierOffloadingSpec(config)


def test_a_canonical_namespace_names_the_format_and_not_the_ranks(engine_id):
    def spec(world_size, **fields):
        # One rank's bytes per block halve when twice the ranks split the heads.
        config = offloading_config(
            engine_id,
            {"cpu_bytes_to_use": 1 << 20},
            worker_kv_bytes_per_block=4096 // world_size,
            world_size=world_size,
            **fields,
        )
        built = KVTierOffloadingSpec(config)
        return storage_namespace(built.kvtier_config, built.kvtier_spec.geometry), built

    one, _ = spec(1, canonical_layout=True)
    two, two_spec = spec(2, canonical_layout=True)
    assert one == two and ";canonical=v1-nhd;" in one and "world=" not in one
    assert two_spec.kvtier_spec.geometry.shared_column
    direct_one, _ = spec(1)
    direct_two, _ = spec(2)
    assert len({one, direct_one, direct_two}) == 3


def whole_page(page: int, *, agnostic: bool = True) -> vllm_base.CanonicalPageMapping:
    """One rank's mapping of a page onto the canonical page it alone makes up."""
    run = vllm_base.CopyRun(0, 0, page, 1, page, page)
    return vllm_base.CanonicalPageMapping(page, page, (run,), 1, 0, agnostic)


@pytest.mark.parametrize(
    ("mappings", "message"),
    [
        ((None, None), "could not certify a layer of KV-cache group 0"),
        ((whole_page(2048, agnostic=False),) * 2, "could not certify"),
        ((whole_page(2048), whole_page(1024)), "map its pages differently"),
    ],
    ids=["uncertified", "not-agnostic", "two-maps-for-one-tensor"],
)
def test_a_canonical_worker_refuses_layers_vllm_did_not_certify_alike(engine_id, mappings, message):
    # Two layers sharing one tensor, as vLLM's refs name them; no worker is built.
    config = offloading_config(engine_id, {"cpu_bytes_to_use": 1 << 20}, canonical_layout=True)
    spec = KVTierOffloadingSpec(config)
    tensor = torch.zeros((8, 2048), dtype=torch.int8)
    caches = vllm_base.CanonicalKVCaches(
        tensors=[vllm_base.CanonicalKVCacheTensor(tensor, 2048)],
        group_data_refs=[[vllm_base.CanonicalKVCacheRef(0, 2048, mapping) for mapping in mappings]],
    )
    with pytest.raises(ValueError, match=f"canonical_layout: .*{message}"):
        spec.get_worker(caches)


def test_an_mla_models_replicated_layout_keeps_one_copy_per_chunk(engine_id):
    config = offloading_config(
        engine_id,
        {"cpu_bytes_to_use": 1 << 20},
        worker_kv_bytes_per_block=4096,
        world_size=2,
        replicated_layout=True,
    )
    spec = KVTierOffloadingSpec(config)
    # vLLM's connector lets rank 0 alone submit the stores of this layout.
    assert spec.replicated_layout
    geometry = spec.kvtier_spec.geometry
    assert geometry.columns == 1 and geometry.chunk_bytes == 4096
    assert ";replicated;" in storage_namespace(spec.kvtier_config, geometry)


def test_every_lookup_result_maps_to_vllms():
    assert set(integration._LOOKUP) == set(kvtier.LookupResult)
    assert set(integration._LOOKUP.values()) == set(vllm_base.LookupResult)
    for ours, theirs in integration._LOOKUP.items():
        assert ours.name == theirs.name


def test_load_store_specs_survive_pickling():
    slots = KVTierSlots((4, 1, 7))
    assert isinstance(slots, vllm_base.LoadStoreSpec)
    assert pickle.loads(pickle.dumps(slots)) == slots


def _prom_classes(registry):
    def bound(cls):
        return type(
            cls.__name__,
            (cls,),
            {"__init__": lambda self, *a, **k: cls.__init__(self, *a, registry=registry, **k)},
        )

    return {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}


def test_vllms_prometheus_metrics_accept_every_stat(make_engine, tmp_path):
    extra = {
        "cpu_bytes_to_use": 256 * 4096,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "fs")}],
    }
    engine = make_engine(extra)
    engine.add("r", list(range(3, 3 + 5 * 16)))
    engine.run()
    engine.drain_tiers()
    assert engine.connector_stats
    registry = CollectorRegistry()
    metrics = OffloadPromMetrics(engine.config, _prom_classes(registry), ["engine"], {0: ["0"]})
    for payload in engine.connector_stats:
        metrics.observe(payload)
    queries = registry.get_sample_value(
        "kvtier_tiering_chunk_queries_total", {"engine": "0", "tier": "0:primary"}
    )
    assert queries is not None and queries > 0
    # Five chunks cascaded to fs once each: the deltas add up to exactly that.
    written = registry.get_sample_value(
        "kvtier_tiering_write_bytes_total", {"engine": "0", "tier": "1:fs"}
    )
    assert written == 5 * engine.manager.spec.chunk_bytes


def _counted(stats, name):
    """What a vLLM stats payload recorded of ``name``: a counter's sum over its labels,
    a histogram's number of samples (no payload: 0)."""
    if stats is None:
        return 0
    _, values = stats.metric_sections()
    return sum(len(v) if isinstance(v, list) else v for v in values.get(name, {}).values())


def test_vllms_stats_call_each_step_does_not_flush_kvtiers_counts(engine_id):
    # vLLM asks for stats on every step; kvtier flushes at most every so often (at the
    # end of a step, or when its registry is collected). Nothing counted is lost: it
    # comes with the stats after the next flush.
    spec = KVTierOffloadingSpec(offloading_config(engine_id, {"cpu_bytes_to_use": 1 << 20}))
    manager = spec.get_manager()
    try:
        manager.get_stats()
        ctx = vllm_base.ReqContext("r")
        out = manager.prepare_store([kvtier.make_offload_key(b"k" * 16)], ctx)
        manager.complete_store(out.keys_to_store, ctx)
        assert _counted(manager.get_stats(), "kvtier_cpu_allocation_size") == 0
        list(manager.kvtier.metrics.registry.collect())
        assert _counted(manager.get_stats(), "kvtier_cpu_allocation_size") == 1
    finally:
        manager.shutdown()


def test_vllms_stats_get_every_count_once_the_tiers_fall_idle(engine_id, tmp_path):
    spec = KVTierOffloadingSpec(
        offloading_config(
            engine_id,
            {
                "cpu_bytes_to_use": 1 << 20,
                "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}],
            },
        )
    )
    manager = spec.get_manager()
    try:
        manager.get_stats()
        ctx = vllm_base.ReqContext("r")
        keys = [kvtier.make_offload_key(bytes([i]) * 16) for i in range(3)]
        out = manager.prepare_store(keys, ctx)
        manager.complete_store(out.keys_to_store, ctx)
        payloads = [manager.get_stats()]
        for _ in range(400):
            if not manager.has_pending_work():
                break
            manager.kvtier.host.wait_for_completions_blocking(0.05)
            payloads.append(manager.get_stats())
        assert not manager.has_pending_work()
        payloads.append(manager.get_stats())
        written = sum(_counted(stats, "kvtier_tiering_write_bytes") for stats in payloads)
        assert written == 3 * spec.kvtier_spec.chunk_bytes
    finally:
        manager.shutdown()


def test_a_load_source_names_the_tier_the_chunk_was_promoted_from(engine_id, tmp_path):
    fs = {"type": "fs", "root_dir": str(tmp_path)}
    spec = KVTierOffloadingSpec(
        offloading_config(engine_id, {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [fs]})
    )
    manager = spec.get_manager()
    end = vllm_base.ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
    try:
        on_disk, in_memory = (kvtier.make_offload_key(bytes([i]) * 16) for i in (1, 2))
        writer = vllm_base.ReqContext("w")
        out = manager.prepare_store([on_disk], writer)
        manager.complete_store(out.keys_to_store, writer)
        while manager.has_pending_work():
            manager.kvtier.host.wait_for_completions_blocking(0.05)
        manager.reset_cache()
        manager.on_reset_flushed()
        out = manager.prepare_store([in_memory], writer)
        manager.complete_store(out.keys_to_store, writer)
        reader = vllm_base.ReqContext("r")
        manager.on_new_request(reader)
        for _ in range(400):
            if manager.lookup(on_disk, reader) is vllm_base.LookupResult.HIT:
                break
            manager.on_schedule_end(end)
            manager.kvtier.host.wait_for_completions_blocking(0.05)
        assert manager.lookup(in_memory, reader) is vllm_base.LookupResult.HIT
        assert manager.get_load_source(on_disk, reader) is CacheHitSource.DISK
        assert manager.get_load_source(in_memory, reader) is CacheHitSource.HOST
    finally:
        manager.shutdown()


def test_config_info_fills_the_declared_labels(make_engine):
    engine = make_engine({"cpu_bytes_to_use": 64 * 4096, "blocks_per_chunk": 2})
    [info] = engine.manager.config_info()
    assert set(info) == set(KVTierOffloadingSpec.config_info_keys({}))
    assert info["blocks_per_chunk"] == 2 and info["tiers"] == "none"


def test_a_group_whose_pages_overrun_its_shared_tensor_is_refused_naming_it(engine_id):
    # Group 1's layer sits at group 0's address with larger pages (a packed layout):
    # copying its pages would run into the next tensor's part of the slot.
    spec = KVTierOffloadingSpec(
        offloading_config(engine_id, {"cpu_bytes_to_use": 1 << 20}, groups=2)
    )
    caches = vllm_base.CanonicalKVCaches(
        tensors=[vllm_base.CanonicalKVCacheTensor(torch.zeros((8, 1024), dtype=torch.int8), 1024)],
        group_data_refs=[
            [vllm_base.CanonicalKVCacheRef(0, 1024)],
            [vllm_base.CanonicalKVCacheRef(0, 2048)],
        ],
    )
    with pytest.raises(
        ValueError,
        match=r"KV-cache group 1 \(full attention, layers model\.layers\.1\.self_attn\.attn\)",
    ):
        spec.get_worker(caches)
