"""TieringOffloadingSpec: parsing secondary_tiers, building, and cleaning up on failure."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import make_config, scripted, tiering_config
from scripted_tier import ScriptedTier

from kvtier import (
    ConfigError,
    CPUOffloadingSpec,
    OffloadingSpecFactory,
    SecondaryTierFactory,
    TieringOffloadingSpec,
)
from kvtier.metrics import CounterDef
from kvtier.region import region_path
from kvtier.specs.settings import SpecSettings
from kvtier.tiering.runner import RunnerSettings
from kvtier.tiers.example import ExampleSettings, ExampleTier
from kvtier.tiers.factory import framework_keys


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
    first, second, third = (tier.backpressure for tier in spec.settings.tiers)
    assert (first.policy, first.warmup, first.high_water) == ("drop", 7, 0.005)
    assert (second.policy, second.warmup, second.high_water, second.low_water) == (
        "throttled",
        7,
        0.020,
        0.005,
    )
    assert (third.high_water, third.low_water, third.warmup) == (0.5, 0.1, 7)
    spec.shutdown()


def test_failure_threshold_is_read_and_merged_like_every_backpressure_key(engine_id):
    tiers = [{"type": "example", "backpressure": {}}, {"type": "example", "backpressure": {}}]
    tiers[1]["backpressure"]["failure_threshold"] = 5
    spec = spec_for(engine_id, tiers, backpressure={"failure_threshold": 2})
    try:
        assert [t.backpressure.failure_threshold for t in spec.settings.tiers] == [2, 5]
    finally:
        spec.shutdown()
    with pytest.raises(
        ConfigError, match=r"^backpressure\.failure_threshold: expected a value >= 1"
    ):
        spec_for(engine_id, tiers, backpressure={"failure_threshold": 0})


def test_backpressure_is_off_unless_configured(engine_id):
    spec = spec_for(engine_id, [{"type": "example"}])
    assert spec.settings.tiers[0].backpressure is None
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
        ({"type": "example"}, 32),
        ({"type": "example", "locality": "remote"}, None),
        ({"type": "example", "max_promotion_chunks": 3}, 3),
        ({"type": "example", "locality": "remote", "max_promotion_chunks": 32}, 32),
    ],
)
def test_promotion_chunks_in_flight_default_by_locality(engine_id, tier, expected):
    spec = OffloadingSpecFactory.create_spec(tiering_config(engine_id, [tier]))
    try:
        assert spec.settings.tiers[0].runner.max_promotion_chunks == expected
    finally:
        spec.shutdown()


@pytest.mark.parametrize("key", sorted(framework_keys() - {"type", "module_path"}))
def test_every_framework_key_is_read_and_checked_under_its_path(engine_id, key):
    with pytest.raises(ConfigError) as info:
        spec_for(engine_id, [{"type": "example", key: ["not", "a", "value"]}])
    message = str(info.value)
    assert message.startswith(f"secondary_tiers[0].{key}: ")
    assert "unknown" not in message  # read by the framework, never passed to the tier


def test_a_misspelt_framework_key_is_named_by_its_path(engine_id):
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[1\]\.max_concurent_jobs: unknown"):
        spec_for(engine_id, [{"type": "example"}, {"type": "example", "max_concurent_jobs": 2}])


def test_a_remote_locality_is_the_one_every_reader_sees(engine_id):
    spec = spec_for(engine_id, [{"type": "example", "locality": "remote", "backpressure": {}}])
    try:
        [tier] = spec.settings.tiers
        assert tier.locality == "remote"
        assert (tier.backpressure.high_water, tier.backpressure.low_water) == (0.020, 0.005)
        assert tier.runner.max_promotion_chunks is None
    finally:
        spec.shutdown()


@pytest.mark.parametrize(("written", "read"), [("REMOTE", "remote"), ("Local", "local")])
def test_locality_is_read_in_any_case(engine_id, written, read):
    spec = spec_for(engine_id, [{"type": "example", "locality": written, "backpressure": {}}])
    try:
        [tier] = spec.settings.tiers
        assert tier.locality == read
        assert tier.backpressure.high_water == (0.020 if read == "remote" else 0.005)
    finally:
        spec.shutdown()


def test_an_unknown_locality_is_named_with_the_choices(engine_id):
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.locality: expected one of"):
        spec_for(engine_id, [{"type": "example", "locality": "nearby"}])


def test_a_tier_without_locality_takes_its_class_one(engine_id, tmp_path):
    tiers = [
        {"type": "fs", "root_dir": str(tmp_path)},
        {"type": "s3", "bucket": "kv-cache", "endpoint_url": "http://127.0.0.1:9"},
    ]
    spec = spec_for(engine_id, tiers)
    try:
        assert [tier.locality for tier in spec.settings.tiers] == ["local", "remote"]
    finally:
        spec.shutdown()


def test_the_parsed_settings_are_what_the_tiers_and_the_manager_get(engine_id):
    tiers = [
        {"type": "example", "custom_param": 3, "job_timeout_s": 7, "name": "mem"},
        scripted("parsed", max_concurrent_jobs=2),
    ]
    spec = spec_for(engine_id, tiers)
    try:
        example, scripted_tier = spec.settings.tiers
        assert example.settings == ExampleSettings(custom_param=3)
        assert example.runner.job_timeout_s == 7.0 and example.label == "1:mem"
        # A tier without a settings class: its parameters as it will receive them.
        assert scripted_tier.settings is None and dict(scripted_tier.params) == {"tag": "parsed"}
        manager = spec.get_manager()
        built_example, built_scripted = manager.tiers
        assert built_example.settings is example.settings  # built from the record itself
        assert built_example.ctx.job_timeout_s == 7.0 and built_example.ctx.tier_name == "1:mem"
        assert built_scripted.name == "parsed"
    finally:
        spec.shutdown()


def test_the_parsed_settings_never_show_a_credential(engine_id):
    secret = "Zsecret/Key+ThatMustNeverLeak00000000000"
    tier = {
        "type": "s3",
        "bucket": "kv-cache",
        "access_key_id": "AKIDX",
        "secret_access_key": secret,
    }
    spec = spec_for(engine_id, [tier])
    try:
        shown = repr(spec.settings)
        assert secret not in shown and "AKIDX" not in shown
    finally:
        spec.shutdown()


def test_the_spec_holds_what_one_parse_of_its_config_gives(engine_id, tmp_path):
    config = tiering_config(
        engine_id,
        [{"type": "fs", "root_dir": str(tmp_path), "locality": "remote"}],
        backpressure={"warmup": 2},
    )
    spec = OffloadingSpecFactory.create_spec(config)
    try:
        parsed = SpecSettings.parse(config, spec_name="TieringOffloadingSpec", secondary_tiers=True)
        assert parsed == spec.settings
    finally:
        spec.shutdown()
    unknown = tiering_config(engine_id, [], colour="blue")
    with pytest.raises(ConfigError, match=r"^colour: unknown setting"):
        SpecSettings.parse(unknown, spec_name="TieringOffloadingSpec", secondary_tiers=True)


# ----------------------------------------------- tiers built from their records


def test_every_field_of_the_runner_record_is_a_framework_key():
    runner = {field.name for field in dataclasses.fields(RunnerSettings)}
    assert runner <= framework_keys()
    assert {"type", "module_path", "name", "locality", "backpressure"} <= framework_keys()


def test_a_tier_derives_its_values_once_into_the_record_it_is_built_from(engine_id, tmp_path):
    tiers = [{"type": "fs", "root_dir": str(tmp_path)}]
    spec = spec_for(engine_id, tiers)
    try:
        [parsed] = spec.settings.tiers
        # The engine's chunks are small: the record says where an adaptive depth starts.
        assert parsed.settings.start_depth == 4
        [built] = spec.get_manager().tiers
        assert built.settings is parsed.settings
        assert (built.read_depth, built.write_depth) == (4, 4)
    finally:
        spec.shutdown()


def test_a_plugin_with_a_settings_class_that_reads_its_keywords_still_works(engine_id):
    # The form plugins were written in before tiers took their records.
    spec = spec_for(engine_id, [{"type": "KeywordTier", "module_path": __name__, "level": 3}])
    try:
        [config] = spec.settings.tiers
        assert config.settings == KeywordSettings(level=3)
        [tier] = spec.get_manager().tiers
        assert isinstance(tier, KeywordTier) and tier.level == 3
    finally:
        spec.shutdown()


def test_the_metrics_of_a_built_spec_come_from_its_parsed_records(engine_id):
    tiers = [{"type": "example"}, {"type": "KeywordTier", "module_path": __name__, "level": 5}]
    spec = spec_for(engine_id, tiers)
    try:
        from_records = spec.metric_definitions(spec.settings.metrics)
        assert "kvtier_keyword_level_5" in from_records
        assert (
            from_records.keys()
            == TieringOffloadingSpec.build_metric_definitions({"secondary_tiers": tiers}).keys()
        )
    finally:
        spec.shutdown()


def test_metric_definitions_from_extra_config_alone_check_what_they_read():
    with pytest.raises(ConfigError, match=r"^store_threshold: "):
        CPUOffloadingSpec.build_metric_definitions({"store_threshold": "two"})
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.custom_parm: unknown"):
        TieringOffloadingSpec.build_metric_definitions(
            {"secondary_tiers": [{"type": "example", "custom_parm": 1}]}
        )


@dataclasses.dataclass(frozen=True)
class KeywordSettings:
    level: int = 0

    @classmethod
    def from_params(cls, params, path):
        return cls(level=params.get("level", 0))


class KeywordTier(ScriptedTier):
    """A plugin that names a settings class yet reads its keyword arguments itself."""

    settings_class = KeywordSettings

    def __init__(self, ctx, **params):
        self.level = params.pop("level")
        super().__init__(ctx, **params)

    @classmethod
    def build_metric_definitions(cls, settings):
        return {f"kvtier_keyword_level_{settings.level}": CounterDef("A level.", ("tier",))}
