import pytest

from kvtier import ConfigError, CPUOffloadingSpec, OffloadingConfig, OffloadingSpecFactory
from kvtier.config import PAGE_SIZE, ChunkGeometry, ConfigReader


def spec_for(extra, **fields):
    fields.setdefault("engine_id", "cfg")
    fields.setdefault("kv_bytes_per_block", 4096)
    return OffloadingSpecFactory.create_spec(OffloadingConfig(extra_config=extra, **fields))


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"engine_id": ""}, "engine_id"),
        ({"engine_id": "../etc"}, "engine_id"),
        ({"kv_bytes_per_block": 0}, "kv_bytes_per_block"),
        ({"kv_bytes_per_block": True}, "kv_bytes_per_block"),
        ({"tokens_per_block": 0}, "tokens_per_block"),
        ({"world_size": 0}, "world_size"),
        ({"world_size": 2, "rank": 2}, "rank"),
        ({"extra_config": ["cpu_bytes_to_use"]}, "extra_config"),
    ],
)
def test_invalid_engine_description_names_the_field(fields, path):
    base = {"engine_id": "e", "kv_bytes_per_block": 4096}
    base.update(fields)
    with pytest.raises(ConfigError) as info:
        OffloadingConfig(**base)
    assert info.value.path == path
    assert str(info.value).startswith(f"{path}: ")


def test_missing_cpu_bytes_to_use_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^cpu_bytes_to_use: is required"):
        spec_for({})


def test_block_size_must_be_a_multiple_of_tokens_per_block():
    with pytest.raises(
        ConfigError, match=r"^block_size: expected a multiple of tokens_per_block=16"
    ):
        spec_for({"cpu_bytes_to_use": 10**8, "block_size": 24})


def test_sizes_that_leave_no_chunk_are_rejected_with_the_chunk_size():
    with pytest.raises(ConfigError, match=r"^cpu_bytes_to_use: .*takes 8192 bytes"):
        spec_for({"cpu_bytes_to_use": 8000, "block_size": 32})


def test_unknown_eviction_policy_lists_the_known_ones():
    known = r"expected one of arc, (.*, )?lru,"  # other tests may register more
    with pytest.raises(
        ConfigError, match=rf"^eviction_policy: unknown eviction policy 'mru'; {known}"
    ):
        spec_for({"cpu_bytes_to_use": 10**6, "eviction_policy": "mru"})


def test_unknown_setting_is_an_error_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"^cpu_byte_to_use: .*did you mean 'cpu_bytes_to_use'"):
        spec_for({"cpu_bytes_to_use": 10**6, "cpu_byte_to_use": 5})


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("cpu_bytes_to_use", "lots", "expected an integer"),
        ("cpu_bytes_to_use", 0, "expected a value >= 1"),
        ("offload_prompt_only", "yes", "expected true or false"),
        ("store_threshold", -1, "expected a value >= 0"),
        ("eviction_policy", 3, "expected a string"),
    ],
)
def test_badly_typed_values_name_key_and_expectation(key, value, expected):
    extra = {"cpu_bytes_to_use": 10**6, key: value}
    with pytest.raises(ConfigError, match=rf"^{key}: {expected}"):
        spec_for(extra)


def test_cpu_spec_refuses_secondary_tiers():
    with pytest.raises(ConfigError, match=r"^secondary_tiers: .*TieringOffloadingSpec"):
        spec_for({"cpu_bytes_to_use": 10**6, "secondary_tiers": []})


def test_sizing_follows_the_design_formula():
    spec = spec_for(
        {"cpu_bytes_to_use": 10**7, "block_size": 48}, kv_bytes_per_block=1000, world_size=3
    )
    assert isinstance(spec, CPUOffloadingSpec)
    blocks_per_chunk = 3
    chunk = -(-1000 * 3 * blocks_per_chunk // PAGE_SIZE) * PAGE_SIZE
    assert spec.geometry == ChunkGeometry(
        tokens_per_block=16,
        blocks_per_chunk=blocks_per_chunk,
        world_size=3,
        column_bytes=1000 * blocks_per_chunk,
        chunk_bytes=chunk,
        num_chunks=10**7 // chunk,
    )


def test_json_floats_with_integral_values_are_accepted():
    spec = spec_for({"cpu_bytes_to_use": 1e7})
    assert isinstance(spec, CPUOffloadingSpec)
    assert spec.settings.cpu_bytes_to_use == 10**7


def test_reader_names_nested_paths():
    reader = ConfigReader({"root_dir": 5}, "secondary_tiers[1]")
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[1\]\.root_dir: expected a string"):
        reader.string("root_dir")


def test_reader_hides_secret_values():
    reader = ConfigReader({"secret": 12345}, "secondary_tiers[0]")
    with pytest.raises(ConfigError) as info:
        reader.string("secret", secret=True)
    assert "12345" not in str(info.value)
