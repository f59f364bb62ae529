import threading

import pytest
import torch
from helpers import keys, scripted, tiering_config
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from scripted_tier import ScriptedTier

from kvtier import CPUOffloadingSpec, KVTier, OffloadingSpecFactory, ReqContext
from kvtier.metrics import CounterDef, GaugeDef, HistogramDef, MetricsRecorder


def test_definitions_bind_to_the_given_registry():
    registry = CollectorRegistry()
    recorder = MetricsRecorder(
        {
            "kvtier_test_things": CounterDef("things", ("tier",)),
            "kvtier_test_level": GaugeDef("level"),
            "kvtier_test_seconds": HistogramDef("seconds", buckets=(0.1, 1.0)),
        },
        registry,
    )
    recorder.inc("kvtier_test_things", 3, ("1:fs",))
    recorder.set("kvtier_test_level", 0.25)
    recorder.observe("kvtier_test_seconds", 0.5)
    assert registry.get_sample_value("kvtier_test_things_total", {"tier": "1:fs"}) == 3
    assert registry.get_sample_value("kvtier_test_level") == 0.25
    assert registry.get_sample_value("kvtier_test_seconds_bucket", {"le": "1.0"}) == 1
    assert REGISTRY.get_sample_value("kvtier_test_things_total", {"tier": "1:fs"}) is None


def test_a_counters_total_is_what_a_scrape_shows_without_collecting():
    registry = CollectorRegistry()
    recorder = MetricsRecorder({"kvtier_test_things": CounterDef("things", ("tier",))}, registry)
    pulls = []
    recorder.pull_from(lambda: pulls.append(1))
    recorder.inc("kvtier_test_things", 3, ("1:fs",))
    recorder.inc("kvtier_test_things", 2.5, ("1:fs",))
    recorder.inc("kvtier_test_things", 7, ("2:s3",))
    assert recorder.total("kvtier_test_things", ("1:fs",)) == 5.5
    assert recorder.total("kvtier_test_things", ("3:p2p",)) == 0.0
    assert pulls == []  # read from the recorder, not by a collection of the registry
    assert registry.get_sample_value("kvtier_test_things_total", {"tier": "1:fs"}) == 5.5
    assert registry.get_sample_value("kvtier_test_things_total", {"tier": "2:s3"}) == 7


def test_recording_an_undefined_name_does_nothing():
    recorder = MetricsRecorder({})
    recorder.inc("kvtier_nothing")
    assert recorder.sample("kvtier_nothing_total") is None


def test_two_recorders_do_not_collide_on_private_registries():
    MetricsRecorder({"kvtier_x": CounterDef("x")})
    MetricsRecorder({"kvtier_x": CounterDef("x")})


def test_unknown_definition_type_is_rejected():
    with pytest.raises(TypeError, match="unknown definition type"):
        MetricsRecorder({"kvtier_x": object()})  # type: ignore[dict-item]


def test_cpu_spec_metric_names_use_the_kvtier_prefix():
    names = CPUOffloadingSpec.build_metric_definitions({"store_threshold": 2})
    assert set(names) == {
        "kvtier_cpu_cache_usage_perc",
        "kvtier_cpu_allocation_size",
        "kvtier_cpu_evictions",
        "kvtier_stores_skipped",
    }
    assert "kvtier_stores_skipped" not in CPUOffloadingSpec.build_metric_definitions({})


def test_a_collection_first_pulls_from_the_source():
    registry = CollectorRegistry()
    recorder = MetricsRecorder({"kvtier_test_things": CounterDef("things")}, registry)
    pulls = []

    def source():
        pulls.append(1)
        recorder.inc("kvtier_test_things", 2)

    recorder.pull_from(source)
    assert registry.get_sample_value("kvtier_test_things_total") == 2
    assert registry.get_sample_value("kvtier_test_things_total") == 4
    recorder.pull_from(None)
    assert registry.get_sample_value("kvtier_test_things_total") == 4
    assert len(pulls) == 2


def test_a_failing_source_is_logged_and_the_collection_still_answers(caplog):
    registry = CollectorRegistry()
    recorder = MetricsRecorder({"kvtier_test_level": GaugeDef("level")}, registry)
    recorder.set("kvtier_test_level", 0.5)

    def source():
        raise RuntimeError("cannot flush")

    recorder.pull_from(source)
    assert registry.get_sample_value("kvtier_test_level") == 0.5
    assert "flushing metrics for a collection failed" in caplog.text


def test_two_recorders_of_the_same_names_still_clash_on_one_registry():
    registry = CollectorRegistry()
    MetricsRecorder({"kvtier_x": CounterDef("x")}, registry)
    with pytest.raises(ValueError, match="kvtier_x"):
        MetricsRecorder({"kvtier_x": CounterDef("x")}, registry)


def test_an_idle_managers_counts_are_current_at_every_scrape(engine_id):
    registry = CollectorRegistry()
    config = tiering_config(engine_id, [{"type": "example"}], chunks=8)
    spec = OffloadingSpecFactory.create_spec(config, registry=registry)
    manager = spec.get_manager()  # a synchronous host: the tiers on a loop thread
    try:
        req = ReqContext("r")
        stored = keys("scrape", 3)
        manager.prepare_store(stored[:2], req)
        # Two of eight slots being written, seen without a step ending.
        assert registry.get_sample_value("kvtier_cpu_cache_usage_perc") == 0.25
        manager.prepare_store(stored, req)
        manager.complete_store(stored, req)
        reader = ReqContext("reader")  # a request that stored was scheduled: it counts none
        for key in [*stored, *keys("absent", 2)]:
            manager.lookup(key, reader)
        # No on_schedule_end: the engine went idle right after these calls. A scrape
        # from a thread of its own (as an HTTP exporter's) still sees them.
        scraped: list[bytes] = []
        scraper = threading.Thread(target=lambda: scraped.append(generate_latest(registry)))
        scraper.start()
        scraper.join(10)
        text = scraped[0].decode()
        assert 'kvtier_tiering_chunk_queries_total{tier="0:primary"} 5.0' in text
        assert 'kvtier_tiering_chunk_hits_total{tier="0:primary"} 3.0' in text
    finally:
        spec.shutdown()


@pytest.mark.anyio
async def test_after_drain_a_scrape_shows_backpressure_drops_and_the_average(engine_id):
    tier = scripted(
        "scrape-pressure",
        instant=True,
        backpressure={"policy": "drop", "warmup": 1, "high_water": 1e-6, "low_water": 1e-7},
    )
    registry = CollectorRegistry()
    kv_cache = torch.zeros((16, 4096), dtype=torch.uint8)
    async with KVTier(tiering_config(engine_id, [tier], chunks=16), [kv_cache], registry) as kv:
        for i in range(6):
            assert await kv.store(keys(f"pressure{i}", 1), [i], f"w{i}") == 1
            await kv.drain()
        label = {"tier": kv.manager.diagnostics.tier_labels[0]}
        stores = registry.get_sample_value(
            "kvtier_tiering_backpressure_stores_dropped_total", label
        )
        chunks = registry.get_sample_value(
            "kvtier_tiering_backpressure_chunks_dropped_total", label
        )
        average = registry.get_sample_value("kvtier_tiering_backpressure_store_latency_ema", label)
        assert stores is not None and stores >= 1
        assert chunks == stores  # one chunk per store
        assert average is not None and average > 0
        assert len(ScriptedTier.instances["scrape-pressure"].store_jobs) == 6 - stores
