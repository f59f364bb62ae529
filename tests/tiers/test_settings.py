"""Tier settings: every documented parameter is read, checked and named by its key path.

The settings dataclasses are the reference documentation of the tiers' parameters:
these tests hold each field to being read from its key, checked with an error that
names ``secondary_tiers[i].<key>``, and documented with a ``#:`` comment. A field
added without a line in the tables below fails them.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import tiering_config
from s3_servers import free_port

from kvtier import ConfigError, OffloadingSpecFactory, SecondaryTierFactory
from kvtier.tiers._depth import DepthRange
from kvtier.tiers.example import ExampleSettings, ExampleTier
from kvtier.tiers.fs import FileSystemTier, FsSettings
from kvtier.tiers.kit import Secret, is_derived
from kvtier.tiers.memcached import MemcachedSettings
from kvtier.tiers.mooncake import MooncakeSettings
from kvtier.tiers.p2p import PeerSettings
from kvtier.tiers.redis import RedisSettings
from kvtier.tiers.s3 import S3Settings, S3Tier

PATH = "secondary_tiers[0]"
MIB = 1 << 20
SECRET = "Zsecret/Key+ThatMustNeverLeak00000000000"
TOKEN = "FwoGZXIvYXdzEXAMPLEsessiontoken0000000000000000000001"
KEY_ID = "AKIDTHATMUSTNOTLEAK"

#: A valid value for every parameter, none of them the default.
EVERY_PARAMETER: dict[type, dict[str, Any]] = {
    ExampleSettings: {"custom_param": 67},
    FsSettings: {
        "root_dir": "/data/kv",
        "capacity_bytes": 10**9,
        "read_depth": 2,
        "write_depth": 8,
        "min_depth": 3,
        "max_read_depth": 12,
        "max_write_depth": 24,
        "o_direct": False,
        "fsync": True,
        "shared": False,
    },
    S3Settings: {
        "bucket": "kv-cache",
        "endpoint_url": "https://s3.example.net:9000",
        "region": "eu-west-1",
        "prefix": "team/kv",
        "access_key_id": KEY_ID,
        "secret_access_key": SECRET,
        "session_token": TOKEN,
        "addressing_style": "virtual",
        "ca_bundle": "/etc/kv/ca.pem",
        "max_concurrency": 4,
        "multipart_threshold": 8 * MIB,
        "multipart_part_bytes": 6 * MIB,
        "connect_timeout_s": 0.5,
        "read_timeout_s": 3.0,
        "retry_attempts": 1,
        "job_deadline_s": 7.5,
        "lookup_cache_ttl_s": 0.0,
        "head_before_store": True,
        "sign_payload": True,
    },
}
#: What each settings class needs at the least.
REQUIRED: dict[type, dict[str, Any]] = {
    ExampleSettings: {},
    FsSettings: {"root_dir": "/data/kv"},
    S3Settings: {"bucket": "kv-cache"},
}
SECRET_FIELDS = {"access_key_id", "secret_access_key", "session_token"}


def parameters(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of a settings class that are parameters (not derived from the engine)."""
    return [f for f in dataclasses.fields(cls) if not is_derived(f)]


def every_field() -> list[tuple[type, str]]:
    return [(cls, f.name) for cls in EVERY_PARAMETER for f in parameters(cls)]


def plain(value: object) -> object:
    """A parsed value as it was written in the configuration."""
    if isinstance(value, Secret):
        return value.value
    if isinstance(value, Path):
        return str(value)
    return value


# ------------------------------------------------------------ every field


@pytest.mark.parametrize("cls", list(EVERY_PARAMETER), ids=lambda cls: cls.__name__)
def test_every_parameter_is_read_into_its_field(cls):
    values = EVERY_PARAMETER[cls]
    assert set(values) == {f.name for f in parameters(cls)}, "a field has no test value"
    parsed = cls.from_params(values, PATH)
    for f in parameters(cls):
        assert plain(getattr(parsed, f.name)) == values[f.name], f.name
        assert values[f.name] != f.default, f"{f.name}: pick a value other than the default"


@pytest.mark.parametrize(("cls", "name"), every_field(), ids=lambda x: getattr(x, "__name__", x))
def test_every_parameter_is_checked_under_its_key_path(cls, name):
    marker = "ValueThatMustNotLeak"
    params = {**REQUIRED[cls], name: [marker]}  # no parameter takes a list
    with pytest.raises(ConfigError) as info:
        cls.from_params(params, PATH)
    message = str(info.value)
    assert message.startswith(f"{PATH}.{name}: ")
    assert "unknown setting" not in message  # read, not merely rejected
    if name in SECRET_FIELDS:
        assert marker not in message


@pytest.mark.parametrize(("cls", "name"), every_field(), ids=lambda x: getattr(x, "__name__", x))
def test_every_parameter_is_documented_where_it_is_declared(cls, name):
    source = inspect.getsource(cls)
    declaration = re.search(rf"((?:\n    #:[^\n]*)+)\n    {name}: ", source)
    assert declaration is not None, f"{cls.__name__}.{name} has no #: comment above it"


@pytest.mark.parametrize("cls", list(EVERY_PARAMETER), ids=lambda cls: cls.__name__)
def test_the_least_configuration_gets_the_documented_defaults(cls):
    parsed = cls.from_params(REQUIRED[cls], PATH)
    for f in dataclasses.fields(cls):
        if f.name not in REQUIRED[cls] and f.name != "addressing_style":
            assert getattr(parsed, f.name) == f.default, f.name


# ---------------------------------------------------- missing and unknown


@pytest.mark.parametrize(
    ("cls", "key"), [(FsSettings, "root_dir"), (S3Settings, "bucket")], ids=["fs", "s3"]
)
def test_a_missing_required_parameter_is_named(cls, key):
    with pytest.raises(ConfigError, match=rf"^secondary_tiers\[0\]\.{key}: is required$"):
        cls.from_params({}, PATH)


@pytest.mark.parametrize(
    ("cls", "typo", "meant"),
    [
        (ExampleSettings, "custom_parm", "custom_param"),
        (FsSettings, "root_dri", "root_dir"),
        (FsSettings, "io_concurency", "io_concurrency"),
        (S3Settings, "bukcet", "bucket"),
        (S3Settings, "secret_acess_key", "secret_access_key"),
    ],
)
def test_an_unknown_parameter_is_an_error_that_suggests_the_closest(cls, typo, meant):
    params = {**REQUIRED[cls], typo: SECRET}
    with pytest.raises(ConfigError) as info:
        cls.from_params(params, PATH)
    message = str(info.value)
    assert message.startswith(f"{PATH}.{typo}: unknown setting; did you mean '{meant}'?")
    assert SECRET not in message


# ------------------------------------------------------------ per tier


@pytest.mark.parametrize(
    ("params", "key", "says"),
    [
        ({"custom_param": "x"}, "custom_param", "expected an integer"),
        ({"custom_param": 1.5}, "custom_param", "expected an integer"),
    ],
)
def test_bad_example_parameters_name_their_key(params, key, says):
    with pytest.raises(ConfigError, match=rf"^secondary_tiers\[0\]\.{key}: .*{says}"):
        ExampleSettings.from_params(params, PATH)


@pytest.mark.parametrize(
    ("params", "key", "says"),
    [
        ({"root_dir": ""}, "root_dir", "must not be empty"),
        ({"capacity_bytes": 0}, "capacity_bytes", ">= 1"),
        ({"io_concurrency": 0}, "io_concurrency", ">= 1"),
        ({"read_depth": 0}, "read_depth", ">= 1"),
        ({"write_depth": 300}, "write_depth", "<= 256"),
        ({"read_depth": "adaptive"}, "read_depth", 'expected "auto" or an integer'),
        ({"io_concurrency": "many"}, "io_concurrency", 'expected "auto" or an integer'),
        ({"min_depth": 0}, "min_depth", ">= 1"),
        ({"max_read_depth": 1}, "max_read_depth", r"expected a value >= min_depth \(2\)"),
        ({"min_depth": 8, "max_write_depth": 4}, "max_write_depth", r">= min_depth \(8\)"),
        ({"max_write_depth": 257}, "max_write_depth", "<= 256"),
        ({"o_direct": "sometimes"}, "o_direct", 'expected "auto", true or false'),
        ({"o_direct": None}, "o_direct", 'expected "auto", true or false'),
        ({"fsync": "yes"}, "fsync", "expected true or false"),
        ({"shared": 1}, "shared", "expected true or false"),
    ],
)
def test_bad_fs_parameters_name_their_key(params, key, says):
    with pytest.raises(ConfigError, match=rf"^secondary_tiers\[0\]\.{key}: .*{says}"):
        FsSettings.from_params({"root_dir": "/data/kv", **params}, PATH)


def test_io_concurrency_sets_both_depths_unless_one_is_given():
    both = FsSettings.from_params({"root_dir": "/r", "io_concurrency": 6}, PATH)
    assert (both.read_depth, both.write_depth) == (6, 6)
    one = FsSettings.from_params({"root_dir": "/r", "io_concurrency": 6, "read_depth": 2}, PATH)
    assert (one.read_depth, one.write_depth) == (2, 6)


def test_depths_adapt_by_default_and_a_number_fixes_them():
    default = FsSettings.from_params({"root_dir": "/r"}, PATH)
    assert (default.read_depth, default.write_depth) == ("auto", "auto")
    # Both start at 16; writes may go deeper (vLLM's tiering writes on 32 threads).
    assert default.read_range == DepthRange(16, 2, 16)
    assert default.write_range == DepthRange(16, 2, 32)
    fixed = FsSettings.from_params({"root_dir": "/r", "io_concurrency": 6}, PATH)
    assert fixed.read_range == fixed.write_range == DepthRange(6, 6, 6)
    assert fixed.read_range.is_fixed


def test_auto_may_be_asked_for_by_name_and_bounded():
    params = {"root_dir": "/r", "io_concurrency": 8, "read_depth": "auto", "max_read_depth": 32}
    settings = FsSettings.from_params(params, PATH)
    assert settings.read_range == DepthRange(16, 2, 32)
    assert settings.write_range == DepthRange.fixed(8)
    low = FsSettings.from_params({"root_dir": "/r", "min_depth": 6, "max_write_depth": 8}, PATH)
    # The start (16) is clipped into the bounds.
    assert low.write_range == DepthRange(8, 6, 8)


def test_fs_root_dir_is_kept_as_written():
    assert FsSettings.from_params({"root_dir": "~/kv"}, PATH).root_dir == Path("~/kv")


@pytest.mark.parametrize(
    ("params", "key", "says"),
    [
        ({"bucket": None}, "bucket", "is required"),
        ({"bucket": "a/b"}, "bucket", "bucket name"),
        ({"endpoint_url": "ftp://host"}, "endpoint_url", "http"),
        ({"endpoint_url": "http://"}, "endpoint_url", "http"),
        ({"region": ""}, "region", "must not be empty"),
        ({"max_concurrency": 0}, "max_concurrency", ">= 1"),
        ({"multipart_threshold": 0}, "multipart_threshold", ">= 1"),
        ({"multipart_part_bytes": 1024}, "multipart_part_bytes", ">="),
        ({"retry_attempts": -1}, "retry_attempts", ">= 0"),
        ({"lookup_cache_ttl_s": -1}, "lookup_cache_ttl_s", ">= 0"),
        ({"connect_timeout_s": 0}, "connect_timeout_s", "> 0"),
        ({"read_timeout_s": float("inf")}, "read_timeout_s", "finite"),
        ({"job_deadline_s": "soon"}, "job_deadline_s", "number"),
        ({"addressing_style": "dns"}, "addressing_style", "one of"),
        ({"prefix": 7}, "prefix", "string"),
        ({"head_before_store": "no"}, "head_before_store", "true or false"),
        ({"sign_payload": 0}, "sign_payload", "true or false"),
        ({"secret_access_key": SECRET}, "access_key_id", "required"),
        ({"access_key_id": KEY_ID}, "secret_access_key", "required"),
        ({"session_token": TOKEN}, "session_token", "needs access_key_id"),
    ],
)
def test_bad_s3_parameters_name_their_key_and_no_secret(params, key, says):
    with pytest.raises(ConfigError, match=rf"^secondary_tiers\[0\]\.{key}: .*{says}") as info:
        S3Settings.from_params({"bucket": "kvtier", **params}, PATH)
    for secret in (SECRET, TOKEN, KEY_ID):
        assert secret not in str(info.value)


def test_s3_addressing_style_follows_the_endpoint():
    assert S3Settings.from_params({"bucket": "b1"}, PATH).addressing_style == "auto"
    local = S3Settings.from_params({"bucket": "b1", "endpoint_url": "http://127.0.0.1:9"}, PATH)
    assert local.addressing_style == "path"


def test_s3_prefix_loses_its_slashes():
    assert S3Settings.from_params({"bucket": "b1", "prefix": "/team/kv/"}, PATH).prefix == "team/kv"


def test_s3_credentials_are_secrets_that_never_show():
    parsed = S3Settings.from_params(EVERY_PARAMETER[S3Settings], PATH)
    shown = [repr(parsed), str(parsed), f"{parsed}"]
    for secret in (SECRET, TOKEN, KEY_ID):
        assert all(secret not in text for text in shown)
    assert parsed.credentials() == {
        "aws_access_key_id": KEY_ID,
        "aws_secret_access_key": SECRET,
        "aws_session_token": TOKEN,
    }
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(parsed)
    assert S3Settings.from_params({"bucket": "b1"}, PATH).credentials() == {}


def test_s3_job_deadline_stays_below_the_tier_job_timeout():
    default = S3Settings.from_params({"bucket": "b1"}, PATH)
    assert default.job_deadline_for(30.0, PATH) == pytest.approx(20.0)
    given = S3Settings.from_params({"bucket": "b1", "job_deadline_s": 5}, PATH)
    assert given.job_deadline_for(30.0, PATH) == 5.0
    with pytest.raises(
        ConfigError,
        match=r"^secondary_tiers\[0\]\.job_deadline_s: must be below the tier's "
        r"job_timeout_s \(5 s\)",
    ):
        given.job_deadline_for(5.0, PATH)


def test_s3_chunk_objects_must_fit_the_part_limit():
    settings = S3Settings.from_params(
        {"bucket": "b1", "multipart_threshold": 1, "multipart_part_bytes": 5 * MIB}, PATH
    )
    assert settings.object_bytes_for(MIB, PATH) == 4096 + MIB
    with pytest.raises(
        ConfigError, match=r"^secondary_tiers\[0\]\.multipart_part_bytes: .* S3 allows 10000"
    ):
        settings.object_bytes_for(10_000 * 5 * MIB, PATH)


# --------------------------------------------------------- tiers use them


BUILT_IN_SETTINGS = {
    "example": ExampleSettings,
    "fs": FsSettings,
    "s3": S3Settings,
    "obj": S3Settings,
    "p2p": PeerSettings,
    "memcached": MemcachedSettings,
    "redis": RedisSettings,
    "mooncake": MooncakeSettings,
}


@pytest.mark.parametrize(("name", "settings_class"), BUILT_IN_SETTINGS.items())
def test_every_built_in_tier_names_its_settings(name, settings_class):
    assert SecondaryTierFactory.get_tier_class({"type": name}).settings_class is settings_class


def test_the_built_in_tiers_above_are_all_of_them():
    # The factory's own registry lines: other tests register plugins beside them.
    source = inspect.getsource(SecondaryTierFactory)
    built_in = re.findall(r'_registry\.register\("(\w+)"', source)
    assert len(built_in) >= 8
    assert sorted(built_in) == sorted(BUILT_IN_SETTINGS)


def test_check_params_validates_a_configuration_without_building_anything(tmp_path):
    root = tmp_path / "not" / "yet"
    FileSystemTier.check_params({"root_dir": str(root), "o_direct": True}, PATH)
    assert not root.exists()
    # A port nobody listens on: checking never connects, so it neither fails nor waits.
    S3Tier.check_params(
        {"bucket": "kvtier", "endpoint_url": f"http://127.0.0.1:{free_port()}"}, PATH
    )
    ExampleTier.check_params({"custom_param": 3}, PATH)
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[2\]\.root_dir: is required"):
        FileSystemTier.check_params({}, "secondary_tiers[2]")


def test_a_built_tier_holds_the_settings_its_parameters_give(engine_id, tmp_path):
    params = [
        {"type": "example", "custom_param": 67},
        {"type": "fs", "root_dir": str(tmp_path), "io_concurrency": 2, "shared": False},
    ]
    spec = OffloadingSpecFactory.create_spec(tiering_config(engine_id, params))
    try:
        example, fs = spec.get_manager().tiers
        assert example.settings == ExampleSettings(custom_param=67)
        # The small chunks of this engine start an adaptive depth at 4.
        assert fs.settings == FsSettings(
            root_dir=tmp_path, read_depth=2, write_depth=2, shared=False, start_depth=4
        )
    finally:
        spec.shutdown()


def test_the_redis_tier_without_redis_py_names_the_extra_to_install(monkeypatch):
    for module in {"redis", *(name for name in sys.modules if name.startswith("redis."))}:
        monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "kvtier.tiers.redis")
    # The registry wraps this in a ConfigError naming secondary_tiers[i].type.
    with pytest.raises(ImportError, match=r"pip install 'redis>=5.0.1' \(kvtier's extra redis\)"):
        importlib.import_module("kvtier.tiers.redis")
