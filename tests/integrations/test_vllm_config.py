"""vLLM's kv_connector_extra_config as kvtier's adapter reads it (without vLLM): every key
of vLLM 0.33's tiering spec and built-in tiers translated, or refused saying why."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import make_config
from vllm_keys import vllm_tiering_config

from kvtier import ConfigError, OffloadingSpecFactory
from kvtier.integrations.vllm_config import adapter_extra_config, translate
from kvtier.specs.factory import with_spec_name
from kvtier.specs.settings import SpecSettings

TOKENS_PER_BLOCK = 16


def settings_of(engine_id: str, extra: dict[str, Any]) -> SpecSettings:
    """The settings kvtier's spec reads from what the adapter hands it."""
    translated = with_spec_name(adapter_extra_config(extra, TOKENS_PER_BLOCK))
    spec = OffloadingSpecFactory.create_spec(make_config(engine_id, **translated))
    try:
        return spec.settings
    finally:
        spec.shutdown()


def tier_with(tier: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier], **extra}


def test_every_key_of_vllms_tiering_spec_reaches_kvtiers_settings(engine_id, tmp_path):
    settings = settings_of(engine_id, vllm_tiering_config(str(tmp_path)))
    assert settings.max_tracked_lookups == 32_000
    fs, obj = settings.tiers
    assert (fs.settings.read_depth, fs.settings.write_depth) == (4, 4)
    assert fs.settings.capacity_bytes == 1 << 30
    assert (fs.locality, fs.events) == ("local", True)
    # The tier's own back-pressure over the top-level one, field by field.
    bp = fs.backpressure
    assert (bp.policy, bp.high_water, bp.low_water, bp.warmup) == ("drop", 0.02, 0.004, 5)
    assert (bp.failure_threshold, bp.alpha, bp.cooldown_s) == (2, 0.2, 1.0)

    s3 = obj.settings
    assert obj.tier_class.__name__ == "S3Tier"
    assert (s3.bucket, s3.endpoint_url, s3.region) == (
        "kv-cache",
        "http://127.0.0.1:9000",
        "us-east-1",
    )
    assert s3.access_key_id.value == "AKIDVLLMKEYS"
    assert s3.secret_access_key.value == "vllm-secret-key-never-shown"
    assert (s3.session_token, s3.ca_bundle) == (None, None)  # empty: not set, as vLLM reads it
    assert (s3.prefix, s3.max_concurrency) == ("vllm/kv", 8)
    assert (obj.locality, obj.events) == ("remote", False)
    # vLLM's detector defaults for a remote storage tier, under the top-level keys.
    bp = obj.backpressure
    assert (bp.policy, bp.alpha) == ("throttled", 0.2)
    assert (bp.high_water, bp.low_water, bp.warmup, bp.failure_threshold) == (0.05, 0.01, 10, 3)


def test_vllms_detector_defaults_follow_the_tier_type_and_locality(engine_id, tmp_path):
    named = {"backpressure_cls": "EMABackpressureDetector"}
    tiers = [
        {"type": "fs", "root_dir": str(tmp_path), "backpressure": named},
        {"type": "fs", "root_dir": str(tmp_path), "locality": "REMOTE", "backpressure": named},
        {"type": "example", "backpressure": named},
    ]
    local_fs, remote_fs, example = (
        t.backpressure
        for t in settings_of(
            engine_id, {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": tiers}
        ).tiers
    )
    assert (local_fs.high_water, local_fs.low_water, local_fs.failure_threshold) == (0.01, 0.002, 3)
    assert (remote_fs.high_water, remote_fs.low_water) == (0.05, 0.01)
    assert (example.high_water, example.failure_threshold) == (0.01, None)


def test_backpressure_merges_as_vllm_merges_it(engine_id):
    tiers = [{"type": "example"}, {"type": "example", "backpressure": {}}]
    # An empty top-level mapping gives no tier back-pressure; an empty tier one does.
    first, second = settings_of(
        engine_id, {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": tiers, "backpressure": {}}
    ).tiers
    assert first.backpressure is None
    assert second.backpressure is not None
    # Without backpressure_cls, kvtier's own defaults.
    assert second.backpressure.high_water == 0.005


def test_an_unknown_tier_type_under_vllms_detector_is_named_by_kvtiers_reading(engine_id):
    named = {"backpressure_cls": "EMABackpressureDetector"}
    extra = tier_with({"type": "nosuchtier", "backpressure": named})
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.type: unknown tier type"):
        settings_of(engine_id, extra)


def test_a_null_failure_threshold_keeps_kvtiers_way_with_failed_stores():
    extra = tier_with(
        {
            "type": "fs",
            "root_dir": "/x",
            "backpressure": {
                "backpressure_cls": "EMABackpressureDetector",
                "failure_threshold": None,
            },
        }
    )
    translation = translate(extra)
    [tier] = translation.extra_config["secondary_tiers"]
    assert tier["backpressure"]["failure_threshold"] is None
    shown = [str(reading) for reading in translation.readings]
    assert any(
        r.startswith("secondary_tiers[0].backpressure.failure_threshold -> null") for r in shown
    )


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_vllms_own_policy_classes_are_kvtiers_policies_of_the_same_name(policy):
    module = f"vllm.v1.kv_offload.cpu.policies.{policy}"
    extra = {"eviction_policy": f"{policy.upper()}CachePolicy", "cache_policy_module_path": module}
    translated = translate(extra).extra_config
    assert translated == {"eviction_policy": policy}


@pytest.mark.parametrize(
    ("store_config", "endpoint_url"),
    [
        ({"endpoint_override": "minio:9000"}, "http://minio:9000"),
        ({"endpoint_override": "minio:9000", "scheme": "https"}, "https://minio:9000"),
        ({"endpoint_override": "https://s3.example.net"}, "https://s3.example.net"),
        ({"endpoint_override": "http://minio:9000", "scheme": "http"}, "http://minio:9000"),
        ({"endpoint_override": "", "scheme": "https"}, None),
    ],
)
def test_the_object_stores_endpoint_becomes_an_endpoint_url(store_config, endpoint_url):
    extra = tier_with({"type": "obj", "store_config": {"bucket": "b", **store_config}})
    [tier] = translate(extra).extra_config["secondary_tiers"]
    assert tier.get("endpoint_url") == endpoint_url
    assert "store_config" not in tier and tier["bucket"] == "b"


def test_the_p2p_tiers_host_and_port_become_listen_and_its_nixl_keys_go_unused():
    secret = {"secret_file": "/etc/kvtier/p2p.secret"}
    vllm_p2p = {"type": "p2p", "backends": ["UCX"], "num_threads": 4, **secret}
    translation = translate(
        {
            "secondary_tiers": [
                {**vllm_p2p, "host": "10.1.2.3", "port": 5711},
                {**vllm_p2p, "port": 5712},
            ]
        }
    )
    first, second = translation.extra_config["secondary_tiers"]
    assert first == {"type": "p2p", "listen": "10.1.2.3:5711", **secret}
    assert second["listen"] == "localhost:5712"  # vLLM's default host
    shown = "\n".join(map(str, translation.readings))
    assert "secondary_tiers[0].backends -> not used: kvtier's p2p tier moves chunks over" in shown


def test_readings_never_show_a_credential(tmp_path):
    shown = "\n".join(map(str, translate(vllm_tiering_config(str(tmp_path))).readings))
    hidden = "secondary_tiers[1].secret_access_key = <hidden>"
    assert f"secondary_tiers[1].store_config.secret_key -> {hidden}" in shown
    assert "AKIDVLLMKEYS" not in shown and "vllm-secret-key-never-shown" not in shown


@pytest.mark.parametrize(
    ("extra", "path", "message"),
    [
        pytest.param(
            tier_with(
                {"type": "example", "backpressure": {"backpressure_cls": "acme.bp.SmartDetector"}}
            ),
            "secondary_tiers[0].backpressure.backpressure_cls",
            "kvtier runs its own back-pressure detector",
            id="third-party-detector",
        ),
        pytest.param(
            {"backpressure": {"policy_cls": "acme.bp.NeverDrop"}, "secondary_tiers": []},
            "backpressure.policy_cls",
            "expected one of vLLM's policies DropStorePolicy, ThrottledDropPolicy",
            id="third-party-policy",
        ),
        pytest.param(
            tier_with(
                {"type": "example", "backpressure": {"high_water_s": 0.1, "high_water": 0.1}}
            ),
            "secondary_tiers[0].backpressure.high_water_s",
            "set either high_water_s (vLLM's name) or high_water, not both",
            id="both-names",
        ),
        pytest.param(
            tier_with({"type": "obj", "store_config": "bucket=b"}),
            "secondary_tiers[0].store_config",
            "expected a mapping of the object store's connection",
            id="store-config-not-a-mapping",
        ),
        pytest.param(
            tier_with({"type": "obj", "store_config": {"bucket": "b", "endpoint": "h:1"}}),
            "secondary_tiers[0].store_config.endpoint",
            "unknown setting of vLLM's store_config",
            id="store-config-unknown-key",
        ),
        pytest.param(
            tier_with(
                {
                    "type": "obj",
                    "store_config": {
                        "bucket": "b",
                        "endpoint_override": "https://h",
                        "scheme": "http",
                    },
                }
            ),
            "secondary_tiers[0].store_config.scheme",
            "is http but endpoint_override is an https URL",
            id="scheme-contradicts-endpoint",
        ),
        pytest.param(
            tier_with({"type": "obj", "store_config": {"bucket": "b"}, "bucket": "c"}),
            "secondary_tiers[0].store_config.bucket",
            "set either store_config.bucket (vLLM's) or bucket, not both",
            id="bucket-twice",
        ),
        pytest.param(
            tier_with({"type": "p2p", "host": "10.1.2.3", "port": 5710}),
            "secondary_tiers[0].secret_file",
            "vLLM's p2p tier (NIXL transfers to peers named per request in kv_transfer_params",
            id="p2p-without-a-secret",
        ),
        pytest.param(
            tier_with({"type": "p2p", "unbound_store_timeout_s": 0, "secret_file": "/s"}),
            "secondary_tiers[0].unbound_store_timeout_s",
            "expected a number > 0",
            id="p2p-hold-time-not-positive",
        ),
        pytest.param(
            {"tier_poll_interval_s": "fast"},
            "tier_poll_interval_s",
            "expected a number",
            id="poll-interval-not-a-number",
        ),
    ],
)
def test_what_kvtier_cannot_read_is_refused_naming_vllms_key_and_why(extra, path, message):
    with pytest.raises(ConfigError) as info:
        translate(extra)
    assert info.value.path == path
    assert message in info.value.problem
