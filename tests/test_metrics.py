import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from kvtier import CPUOffloadingSpec
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
