"""vLLM 0.33 tier plugins under kvtier: a ``SecondaryTierManager`` subclass, named the
out-of-tree way (``type`` + ``module_path``) or registered with vLLM's own
``SecondaryTierFactory``, runs unchanged when the spec is ``KVTierOffloadingSpec``.

The plugin (:mod:`vllm_plugin_tier`) knows vLLM's interface only; vLLM's real
scheduler and connector drive kvtier around it.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import vllm_offline
import vllm_plugin_tier
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory as VllmTierFactory

from kvtier.errors import ConfigError
from kvtier.integrations.vllm import KVTierOffloadingSpec
from kvtier.metrics import Names

SPEC = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm"}
#: vLLM's GPU block in these tests (the engine fixture's), and a primary tier of 256.
TOKENS_PER_BLOCK = 16
PRIMARY_BYTES = 256 * 2 * 2048
#: The name the plugin is registered under with vLLM's factory (once per process).
REGISTERED = "test-threaded-dict"


def offloading_config(engine_id, extra):
    return vllm_offline.offloading_config(engine_id, extra, worker_kv_bytes_per_block=4096)


def prompt(seed: int, num_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(num_blocks * TOKENS_PER_BLOCK)]


def by_module_path(**params):
    return {"type": "ThreadedDictTier", "module_path": "vllm_plugin_tier", **params}


def by_registered_name(**params):
    with contextlib.suppress(ValueError):  # registered by an earlier test
        VllmTierFactory.register_tier(REGISTERED, "vllm_plugin_tier", "ThreadedDictTier")
    return {"type": REGISTERED, **params}


def newest_plugin() -> vllm_plugin_tier.ThreadedDictTier:
    return vllm_plugin_tier.INSTANCES[-1]


def store_then_forget(engine, shared):
    """Store ``shared`` through vLLM, let the cascade land, then empty the GPU prefix
    cache and kvtier's primary tier: a later hit can only come from the plugin."""
    engine.add("first", [*shared, 5, 6, 7])
    engine.run()
    engine.drain_tiers()
    engine.scheduler.reset_prefix_cache(reset_connector=True)
    engine.wipe_gpu()


def test_vllms_factory_builds_the_spec_with_a_vllm_plugin_tier(engine_id):
    # Refused at create_spec before ("is not a subclass of kvtier.SecondaryTier").
    # vLLM hands a tier its locality and enable_kv_events as written: so does kvtier.
    tier = by_module_path(label="x", locality="REMOTE", enable_kv_events=True)
    extra = {**SPEC, "cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]}
    # vLLM's metrics logger declares every metric before any stats arrive: the
    # plugin's own are among the spec's.
    declared = KVTierOffloadingSpec.build_metric_definitions(extra)
    assert vllm_plugin_tier.STORED_CHUNKS in declared
    assert declared[vllm_plugin_tier.STORED_CHUNKS].labelnames == ("label",)
    spec = OffloadingSpecFactory.create_spec(offloading_config(engine_id, extra))
    assert isinstance(spec, KVTierOffloadingSpec)
    manager = spec.get_manager()
    try:
        (tier,) = manager.kvtier.tiers
        from kvtier.integrations.vllm_plugin import VllmPluginTier

        assert isinstance(tier, VllmPluginTier)
        plugin = tier.plugin
        assert isinstance(plugin, vllm_plugin_tier.ThreadedDictTier)
        # Built as vLLM builds it: its spec, the region by rows, its type, its params.
        assert plugin.offloading_spec is spec
        assert plugin.tier_type == "ThreadedDictTier"
        assert plugin.label == "x"
        assert (plugin.locality_written, plugin.enable_kv_events) == ("REMOTE", True)
        assert plugin.block_size_bytes == spec.kvtier_spec.chunk_bytes
    finally:
        manager.shutdown()
    assert plugin.shut_down


@pytest.mark.parametrize("named", [by_module_path, by_registered_name])
def test_a_vllm_plugin_stores_and_promotes_byte_exact_with_its_stats(make_engine, named):
    extra = {"cpu_bytes_to_use": PRIMARY_BYTES, "secondary_tiers": [named(label="mine")]}
    engine = make_engine(extra, events=True)
    plugin = newest_plugin()
    shared = prompt(11, 8)
    store_then_forget(engine, shared)
    assert len(plugin.chunks) >= 8
    engine.add("second", [*shared, 9, 9, 9, 9])
    engine.run()
    # Every token vLLM found computed was promoted from the plugin and compared byte
    # for byte with what was computed for it.
    assert engine.cached_at_start["second"] == 8 * TOKENS_PER_BLOCK
    assert engine.verified_blocks >= 8
    # Its own metric reached vLLM's stats, labelled by its own parameter.
    stored = [
        value
        for payload in engine.connector_stats
        for value in payload["data"].get(vllm_plugin_tier.STORED_CHUNKS, {}).values()
    ]
    assert sum(stored) == len(plugin.chunks)
    assert {
        labels
        for payload in engine.connector_stats
        for labels in payload["data"].get(vllm_plugin_tier.STORED_CHUNKS, {})
    } == {("mine",)}
    # Its events became the tier's KV events, owned by the tier's label.
    stored_events = [e for e in engine.published_events() if type(e).__name__ == "BlockStored"]
    media = {(e.medium, e.ownership) for e in stored_events}
    assert ("CPU", f"1:{named(label='mine')['type']}") in media
    # Requests were opened and finished with it.
    assert {"first", "second"} <= plugin.requests_finished


def test_a_plugin_job_that_never_ends_is_a_counted_miss_and_its_slots_wait(make_engine):
    extra = {
        "cpu_bytes_to_use": PRIMARY_BYTES,
        "secondary_tiers": [by_module_path(label="stall", stall_loads=True, job_timeout_s=1)],
    }
    engine = make_engine(extra)
    plugin = newest_plugin()
    shared = prompt(12, 4)
    store_then_forget(engine, shared)
    engine.add("second", [*shared, 9, 9, 9, 9])
    engine.run(max_steps=1000)
    assert engine.cached_at_start["second"] == 0  # computed again, never served
    assert engine.finished == {"first", "second"}
    kvtier = engine.manager.kvtier
    failures = kvtier.metrics.total(Names.PROMOTION_JOB_FAILURES, ("1:ThreadedDictTier",))
    assert failures >= 1
    # The promotion's slots stay out of use while the plugin may still write them...
    view = kvtier.region.primary_view
    assert view.slots_in_use()
    # ... and come back once it reports the job.
    plugin.release()
    for _ in range(200):
        engine.step()
        if not view.slots_in_use():
            break
        kvtier.host.wait_for_completions_blocking(0.02)
    assert not view.slots_in_use()


def test_a_plugin_that_reports_a_failed_load_is_a_miss(make_engine):
    extra = {
        "cpu_bytes_to_use": PRIMARY_BYTES,
        "secondary_tiers": [by_module_path(label="fail", fail_loads=True)],
    }
    engine = make_engine(extra)
    shared = prompt(13, 4)
    store_then_forget(engine, shared)
    engine.add("second", [*shared, 9, 9, 9, 9])
    engine.run()
    assert engine.cached_at_start["second"] == 0
    assert engine.finished == {"first", "second"}
    kvtier = engine.manager.kvtier
    assert kvtier.metrics.total(Names.PROMOTION_JOB_FAILURES, ("1:ThreadedDictTier",)) >= 1


def test_a_row_the_plugin_loads_wrong_is_never_served(make_engine):
    # kvtier took each row's checksum when the plugin stored it.
    extra = {
        "cpu_bytes_to_use": PRIMARY_BYTES,
        "secondary_tiers": [by_module_path(label="corrupt", corrupt_loads=True)],
    }
    engine = make_engine(extra)
    shared = prompt(14, 4)
    store_then_forget(engine, shared)
    engine.add("second", [*shared, 9, 9, 9, 9])
    engine.run()
    assert engine.cached_at_start["second"] == 0  # the engine's byte check never saw them
    kvtier = engine.manager.kvtier
    assert kvtier.metrics.total(Names.INTEGRITY_FAILURES, ("1:ThreadedDictTier",)) >= 4


def test_rows_stored_by_another_engine_are_served_and_counted_unverified(make_engine, engine_id):
    # A plugin whose chunks outlive the engine (as a disk does): the next engine holds
    # no checksum for them, so they are served as loaded, as under vLLM, and counted.
    tier = by_module_path(label="shared", store=engine_id)
    writer = make_engine({"cpu_bytes_to_use": PRIMARY_BYTES, "secondary_tiers": [tier]})
    shared = prompt(15, 4)
    writer.add("first", [*shared, 5, 6, 7])
    writer.run()
    writer.drain_tiers()
    writer.close()
    reader = make_engine({"cpu_bytes_to_use": PRIMARY_BYTES, "secondary_tiers": [tier]})
    reader.add("second", [*shared, 9, 9, 9, 9])
    reader.run()
    assert reader.cached_at_start["second"] == 4 * TOKENS_PER_BLOCK
    assert reader.verified_blocks >= 4
    from kvtier.integrations.vllm_plugin import UNVERIFIED_CHUNKS

    assert reader.manager.kvtier.metrics.total(UNVERIFIED_CHUNKS, ("1:ThreadedDictTier",)) == 4


def test_a_plugin_parameter_it_does_not_take_is_named(engine_id):
    extra = {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [by_module_path(labl="x")]}
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.labl"):
        KVTierOffloadingSpec(offloading_config(engine_id, {**SPEC, **extra}))


def test_a_class_of_neither_tier_kind_is_refused_naming_the_key(engine_id):
    tier = {"type": "OffloadingSpecFactory", "module_path": "vllm.v1.kv_offload.factory"}
    extra = {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]}
    with pytest.raises(ConfigError) as caught:
        KVTierOffloadingSpec(offloading_config(engine_id, {**SPEC, **extra}))
    assert caught.value.path == "secondary_tiers[0].type"
    assert "kvtier.SecondaryTier or a vLLM SecondaryTierManager" in caught.value.problem
