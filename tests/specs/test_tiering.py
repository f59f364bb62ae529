"""TieringOffloadingSpec: parsing secondary_tiers, building, and cleaning up on failure."""

from __future__ import annotations

import pytest
from helpers import make_config, scripted, tiering_config
from scripted_tier import ScriptedTier

from kvtier import (
    ConfigError,
    OffloadingSpecFactory,
    SecondaryTierFactory,
    TieringOffloadingSpec,
)
from kvtier.region import region_path
from kvtier.tiers.example import ExampleTier


def spec_for(engine_id, tiers, **extra):
    return OffloadingSpecFactory.create_spec(tiering_config(engine_id, tiers, **extra))


def test_spec_name_selects_the_tiering_spec(engine_id):
    spec = spec_for(engine_id, [])
    assert isinstance(spec, TieringOffloadingSpec)
    spec.shutdown()


@pytest.mark.parametrize(
    ("tiers", "path", "message"),
    [
        ({"type": "example"}, "secondary_tiers", "expected a list of mappings"),
        (["example"], r"secondary_tiers\[0\]", "expected a mapping"),
        ([{}], r"secondary_tiers\[0\]\.type", "is required"),
        ([{"type": "tape"}], r"secondary_tiers\[0\]\.type", "unknown tier type 'tape'"),
        (
            [{"type": "example"}, {"type": "fs"}],
            r"secondary_tiers\[1\]\.root_dir",
            "is required",
        ),
        (
            [{"type": "example", "custom_parm": 1}],
            r"secondary_tiers\[0\]\.custom_parm",
            "did you mean 'custom_param'",
        ),
        (
            [{"type": "example", "max_concurrent_jobs": 0}],
            r"secondary_tiers\[0\]\.max_concurrent_jobs",
            "expected a value >= 1",
        ),
        (
            [{"type": "example", "max_promotion_chunks": 0}],
            r"secondary_tiers\[0\]\.max_promotion_chunks",
            "expected a value >= 1",
        ),
        (
            [{"type": "example", "backpressure": {"policy": "panic"}}],
            r"secondary_tiers\[0\]\.backpressure\.policy",
            "expected one of drop, throttled",
        ),
        (
            [{"type": "example", "shutdown_grace_s": -5}],
            r"secondary_tiers\[0\]\.shutdown_grace_s",
            "expected a value >= 0",
        ),
        (
            [{"type": "example", "shutdown_grace_s": "soon"}],
            r"secondary_tiers\[0\]\.shutdown_grace_s",
            "expected a number",
        ),
    ],
)
def test_bad_tier_configuration_names_the_key(engine_id, tiers, path, message):
    with pytest.raises(ConfigError, match=rf"^{path}: .*{message}"):
        spec = spec_for(engine_id, tiers)
        spec.get_manager()  # tier parameters are checked when the tiers are built
        spec.shutdown()


@pytest.mark.parametrize("tiers", [[], [{"type": "example"}]], ids=["no tiers", "a tier"])
def test_a_bad_top_level_backpressure_is_named_by_its_own_key(engine_id, tiers):
    with pytest.raises(ConfigError, match=r"^backpressure\.alpha: expected a value <= 1"):
        spec_for(engine_id, tiers, backpressure={"alpha": 7})
    with pytest.raises(ConfigError, match=r"^backpressure\.polcy: unknown setting"):
        spec_for(engine_id, tiers, backpressure={"polcy": "drop"})


def test_store_threshold_is_rejected_with_a_value_error(engine_id):
    with pytest.raises(ValueError, match=r"^store_threshold: is not supported"):
        spec_for(engine_id, [], store_threshold=2)


def test_out_of_tree_tier_is_imported_by_module_path(engine_id):
    spec = spec_for(engine_id, [scripted("oot")])
    manager = spec.get_manager()
    assert isinstance(manager.tiers[0], ScriptedTier)
    assert manager.diagnostics.tier_labels == ["1:ScriptedTier"]
    spec.shutdown()


def test_registered_tier_is_selected_by_name(engine_id):
    SecondaryTierFactory.register_tier("scripted-registered", "scripted_tier", "ScriptedTier")
    spec = spec_for(engine_id, [{"type": "scripted-registered", "tag": "reg", "name": "mine"}])
    manager = spec.get_manager()
    assert manager.diagnostics.tier_labels == ["1:mine"]
    spec.shutdown()


def test_a_tier_failing_to_start_closes_the_tiers_before_it_and_the_region(engine_id):
    spec = spec_for(engine_id, [scripted("first"), scripted("second", fail_start=True)])
    with pytest.raises(RuntimeError, match="refuses to start"):
        spec.get_manager()
    first = ScriptedTier.instances["first"]
    assert first.started and first.closed
    assert not region_path(engine_id).exists()
    spec.shutdown()


def test_backpressure_defaults_merge_field_by_field_under_each_tier(engine_id):
    spec = spec_for(
        engine_id,
        [
            {"type": "example", "backpressure": {"policy": "drop"}},
            {"type": "example", "locality": "remote"},
            {"type": "example", "backpressure": {"high_water": 0.5, "low_water": 0.1}},
        ],
        backpressure={"warmup": 7},
    )
    first, second, third = (options.backpressure for options in spec.tier_options)
    assert (first.policy, first.warmup, first.high_water) == ("drop", 7, 0.005)
    assert (second.policy, second.warmup, second.high_water, second.low_water) == (
        "throttled",
        7,
        0.020,
        0.005,
    )
    assert (third.high_water, third.low_water, third.warmup) == (0.5, 0.1, 7)
    spec.shutdown()


def test_backpressure_is_off_unless_configured(engine_id):
    spec = spec_for(engine_id, [{"type": "example"}])
    assert spec.tier_options[0].backpressure is None
    spec.shutdown()


def test_low_water_above_high_water_is_rejected(engine_id):
    with pytest.raises(ConfigError, match=r"backpressure\.low_water: must not exceed high_water"):
        spec_for(
            engine_id, [{"type": "example", "backpressure": {"low_water": 1, "high_water": 0.1}}]
        )


def test_metric_definitions_cover_cpu_tiering_and_each_tier():
    extra = {"secondary_tiers": [{"type": "example"}, {"type": "fs", "root_dir": "/unused"}]}
    names = set(TieringOffloadingSpec.build_metric_definitions(extra))
    assert {
        "kvtier_cpu_cache_usage_perc",
        "kvtier_tiering_chunk_hits",
        "kvtier_tiering_lookup_sync_delay_seconds",
        "kvtier_tiering_backpressure_stores_dropped",
        "kvtier_tiering_integrity_failures",
        "kvtier_example_stored_chunks",
        "kvtier_fs_used_bytes",
    } <= names


def test_cpu_spec_metrics_do_not_include_tiering_ones():
    names = set(OffloadingSpecFactory.get_spec_class(make_config("x")).build_metric_definitions({}))
    assert "kvtier_tiering_chunk_hits" not in names


def test_example_tier_is_the_built_in_example():
    assert SecondaryTierFactory.get_tier_class({"type": "example"}) is ExampleTier


@pytest.mark.parametrize(
    ("tier", "expected"),
    [
        ({"type": "example"}, 8),
        ({"type": "example", "locality": "remote"}, None),
        ({"type": "example", "max_promotion_chunks": 3}, 3),
        ({"type": "example", "locality": "remote", "max_promotion_chunks": 32}, 32),
    ],
)
def test_promotion_chunks_in_flight_default_by_locality(engine_id, tier, expected):
    spec = OffloadingSpecFactory.create_spec(tiering_config(engine_id, [tier]))
    try:
        assert spec.tier_options[0].runner.max_promotion_chunks == expected
    finally:
        spec.shutdown()
