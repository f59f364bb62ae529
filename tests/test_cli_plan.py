"""kvtier plan: the KV cache's bytes per block from the model's shape, the paths this
machine lacks, and help text on every option of every command."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.cli._args import build_parser

REGION = ["--set", "cpu_bytes_to_use=67108864"]

#: Llama-3.1-8B's config.json, the keys that size its KV cache.
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}

#: DeepSeek-V3's config.json, the keys that size its (MLA) KV cache.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "kv_lora_rank": 512,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "qk_rope_head_dim": 64,
    "torch_dtype": "bfloat16",
}


def plan(capsys, *argv: str) -> dict:
    assert main(["plan", *REGION, *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def refused(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(["plan", *REGION, *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: ") and err.count("\n") == 1, err
    return err


def config_file(tmp_path: Path, config: dict, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


# --------------------------------------------------------------- help on every option


def every_command(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    commands = {"kvtier": parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands |= {f"kvtier {name}": sub for name, sub in action.choices.items()}
    return commands


def test_every_option_of_every_command_has_help_text():
    commands = every_command(build_parser())
    assert set(commands) == {"kvtier", "kvtier bench", "kvtier inspect", "kvtier plan"}
    for command, parser in commands.items():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            name = action.option_strings[0] if action.option_strings else action.dest
            assert action.help and action.help != argparse.SUPPRESS, f"{command} {name}"


def test_plan_help_says_how_to_compute_the_bytes_per_block(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    per_block = "x head size x dtype bytes x tokens per block"
    assert f"layers x 2 (K and V) x KV heads per rank {per_block}" in text
    assert "an MLA model: layers x latent size x dtype bytes x tokens per block" in text
    # The worked example is the arithmetic plan itself does.
    assert "32 layers x 2 x 8 KV heads x 128 x 2 bytes x 16 = 2,097,152" in text


# ------------------------------------------------------------ the model's shape


@pytest.mark.parametrize(("world_size", "expected"), [("1", 2_097_152), ("2", 1_048_576)])
def test_shape_options_give_the_bytes_per_block_plan_is_given(capsys, world_size, expected):
    shape = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16"]
    from_shape = plan(capsys, *shape, "--tp", world_size)
    given = plan(capsys, "--kv-bytes-per-block", str(expected), "--world-size", world_size)
    assert from_shape["kv_bytes_per_block"] == given["kv_bytes_per_block"] == expected
    assert from_shape["kv_bytes_per_block_from"].endswith(f"= {expected:,}")
    for key in ("chunk_bytes", "num_chunks", "region_bytes", "column_bytes", "world_size"):
        assert from_shape[key] == given[key], key


def test_a_hugging_face_config_gives_the_shape_its_file_or_its_directory(tmp_path, capsys):
    path = config_file(tmp_path, LLAMA_8B)
    from_file = plan(capsys, "--model-config", str(path))
    from_directory = plan(capsys, "--model-config", str(tmp_path))
    assert from_file["kv_bytes_per_block"] == from_directory["kv_bytes_per_block"] == 2_097_152
    assert from_file["kv_bytes_per_block_from"] == (
        "32 layers x 2 (K and V) x 8 KV heads per rank x 128 head size x 2 bytes "
        "(bfloat16) x 16 tokens per block = 2,097,152"
    )


def test_dtype_names_the_kv_cache_s_dtype_over_the_model_s(tmp_path, capsys):
    path = config_file(tmp_path, LLAMA_8B)
    fp8 = plan(capsys, "--model-config", str(path), "--dtype", "fp8")
    auto = plan(capsys, "--model-config", str(path), "--dtype", "auto")
    assert fp8["kv_bytes_per_block"] == 1_048_576
    assert auto["kv_bytes_per_block"] == 2_097_152


def test_a_multimodal_config_is_read_from_its_text_config(tmp_path, capsys):
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "torch_dtype": "float16",
        "vision_config": {"num_hidden_layers": 24, "hidden_size": 1024},
        "text_config": {
            "num_hidden_layers": 40,
            "num_attention_heads": 40,
            "hidden_size": 5120,
        },
    }
    shown = plan(capsys, "--model-config", str(config_file(tmp_path, config)))
    # No num_key_value_heads: every attention head has its own; 5120 / 40 = 128.
    assert shown["kv_bytes_per_block"] == 40 * 2 * 40 * 128 * 2 * 16


def test_an_mla_model_caches_one_latent_the_same_on_every_rank(tmp_path, capsys):
    path = config_file(tmp_path, DEEPSEEK_V3)
    one = plan(capsys, "--model-config", str(path))
    eight = plan(capsys, "--model-config", str(path), "--tp", "8")
    assert one["kv_bytes_per_block"] == eight["kv_bytes_per_block"] == 61 * 576 * 2 * 16
    assert eight["replicated"] is True
    # One copy per chunk, however many ranks: eight ranks' region holds what one's does.
    assert eight["chunk_bytes"] == one["chunk_bytes"]
    assert eight["num_chunks"] == one["num_chunks"]
    latent = plan(capsys, "--layers", "61", "--mla-latent-dim", "576", "--dtype", "bf16")
    assert latent["kv_bytes_per_block"] == one["kv_bytes_per_block"]


def test_fewer_kv_heads_than_ranks_gives_each_rank_one_head(capsys):
    shape = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--dtype", "fp16"]
    assert plan(capsys, *shape, "--tp", "4")["kv_bytes_per_block"] == 2 * 2 * 1 * 64 * 2 * 16


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ["--kv-bytes-per-block", "4096", "--layers", "2"],
            "--kv-bytes-per-block and the model's shape (--layers) both size the KV cache",
            id="bytes-and-shape",
        ),
        pytest.param(
            ["--kv-bytes-per-block", "4096", "--model-config", "CONFIG"],
            "--kv-bytes-per-block and the model's shape (--model-config)",
            id="bytes-and-config",
        ),
        pytest.param(
            ["--model-config", "CONFIG", "--kv-heads", "4"],
            "--model-config gives the model's shape; --kv-heads would change it",
            id="config-and-shape",
        ),
        pytest.param(
            ["--layers", "2", "--dtype", "bf16"],
            "the model's shape needs --kv-heads and --head-dim too",
            id="shape-half-given",
        ),
        pytest.param(
            ["--layers", "2", "--kv-heads", "4", "--head-dim", "64"],
            "the model's shape needs --dtype too",
            id="no-dtype",
        ),
        pytest.param(
            ["--layers", "2", "--mla-latent-dim", "576", "--kv-heads", "4", "--dtype", "bf16"],
            "--mla-latent-dim describes an MLA model's cache, --kv-heads and --head-dim",
            id="mla-and-heads",
        ),
        pytest.param(
            [
                "--layers",
                "2",
                "--kv-heads",
                "3",
                "--head-dim",
                "64",
                "--dtype",
                "bf16",
                "--tp",
                "2",
            ],
            "3 KV heads do not split evenly over 2 tensor-parallel ranks (--world-size)",
            id="uneven-heads",
        ),
        pytest.param(
            ["--layers", "2", "--kv-heads", "4", "--head-dim", "64", "--dtype", "bf17"],
            "unknown dtype 'bf17'; expected one of",
            id="unknown-dtype",
        ),
        pytest.param(
            ["--layers", "2", "--kv-heads", "4", "--head-dim", "64", "--dtype", "auto"],
            "--dtype auto means the model's dtype, read from --model-config",
            id="auto-without-config",
        ),
        pytest.param([], "the KV cache's size is missing", id="nothing"),
        pytest.param(["--layers", "0"], "expected a positive integer, got 0", id="zero-layers"),
    ],
)
def test_a_shape_that_gives_two_answers_or_none_is_refused(tmp_path, capsys, argv, message):
    path = config_file(tmp_path, LLAMA_8B)
    argv = [str(path) if arg == "CONFIG" else arg for arg in argv]
    assert message in refused(capsys, *argv)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        pytest.param(
            {"num_hidden_layers": 2, "torch_dtype": "bfloat16"},
            "has no num_attention_heads",
            id="no-heads",
        ),
        pytest.param(
            {**LLAMA_8B, "torch_dtype": None},
            "names no torch_dtype; give the KV cache's --dtype",
            id="no-dtype",
        ),
        pytest.param(
            {**LLAMA_8B, "layer_types": ["full_attention", "linear_attention"]},
            "layers of type linear_attention keep no K and V cache",
            id="hybrid",
        ),
        pytest.param([1, 2], "must hold a JSON object", id="not-an-object"),
    ],
)
def test_a_config_json_that_cannot_size_the_cache_is_refused(tmp_path, capsys, config, message):
    assert message in refused(capsys, "--model-config", str(config_file(tmp_path, config)))


def test_a_missing_config_json_is_refused(tmp_path, capsys):
    assert "cannot read" in refused(capsys, "--model-config", str(tmp_path / "none.json"))
    assert f"cannot read {tmp_path}/config.json" in refused(capsys, "--model-config", str(tmp_path))


# --------------------------------------------------- paths this machine lacks


def fs_tiers(*root_dirs: Path) -> list[str]:
    tiers = [{"type": "fs", "root_dir": str(root)} for root in root_dirs]
    return ["--set", f"secondary_tiers={json.dumps(tiers)}"]


def test_a_root_dir_whose_parent_is_missing_is_warned_of(tmp_path, capsys):
    missing = tmp_path / "no-such-disk" / "kvcache"
    argv = ["plan", *REGION, "--kv-bytes-per-block", "65536", *fs_tiers(tmp_path / "a", missing)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err == (
        f"kvtier: warning: secondary_tiers[1].root_dir: {missing.parent} does not exist on "
        "this machine; the fs tier creates kvcache, never its parents, so it would fail to "
        "start here\n"
    )


def test_a_root_dir_that_exists_or_whose_parent_does_is_not_warned_of(tmp_path, capsys):
    (tmp_path / "there").mkdir()
    roots = fs_tiers(tmp_path / "there", tmp_path / "new")
    assert main(["plan", *REGION, "--kv-bytes-per-block", "65536", *roots]) == 0
    assert capsys.readouterr().err == ""


def test_a_missing_file_a_tier_reads_is_warned_of(tmp_path, capsys):
    tier = {"type": "redis", "url": "rediss://cache:6379/0", "tls_ca_file": str(tmp_path / "ca")}
    tiers = ["--set", f"secondary_tiers={json.dumps([tier])}"]
    assert main(["plan", *REGION, "--kv-bytes-per-block", "65536", *tiers]) == 0
    assert capsys.readouterr().err == (
        f"kvtier: warning: secondary_tiers[0].tls_ca_file: {tmp_path / 'ca'} is not a file "
        "on this machine\n"
    )
