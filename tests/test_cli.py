import json
import subprocess
import sys

import pytest

from kvtier.cli import main


def test_plan_prints_the_geometry_as_json(capsys):
    code = main(
        ["plan", "--kv-bytes-per-block", "131072", "--set", "cpu_bytes_to_use=1048576", "--json"]
    )
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["num_chunks"] == 8
    assert plan["chunk_bytes"] == 131072
    assert plan["spec"] == "CPUOffloadingSpec"


def test_plan_reads_extra_config_from_a_file(tmp_path, capsys):
    config = tmp_path / "extra.json"
    config.write_text(
        json.dumps({"cpu_bytes_to_use": 4 * 65536, "block_size": 32, "eviction_policy": "arc"})
    )
    assert main(["plan", "--kv-bytes-per-block", "32768", "--config", str(config), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["blocks_per_chunk"] == 2 and plan["eviction_policy"] == "arc"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--kv-bytes-per-block", "4096"], "cpu_bytes_to_use: is required"),
        (
            [
                "plan",
                "--kv-bytes-per-block",
                "4096",
                "--set",
                "cpu_bytes_to_use=65536",
                "--set",
                "colour=1",
            ],
            "colour",
        ),
        (["plan", "--kv-bytes-per-block", "4096", "--config", "/no/such.json"], "cannot read"),
        (["plan"], "--kv-bytes-per-block"),
        (["frobnicate"], "invalid choice"),
        (["bench", "--workload", "chat"], "invalid choice: 'chat'"),
        (["bench", "--tiers", "tape"], "--tiers: unknown tier 'tape'"),
        (["bench", "--tiers", "fs,s3,fs"], "--tiers: fs is named twice"),
        (["bench", "--tiers", ","], "--tiers needs at least one tier"),
        (["bench", "--config", "/no/such/file.json"], "cannot read /no/such/file.json"),
        (["bench", "--concurrency", "0"], "expected a positive integer"),
        (["bench", "--metrics-port", "70000"], "--metrics-port must be a TCP port"),
        (["inspect", "/no/such/dir"], "/no/such/dir does not exist"),
    ],
)
def test_bad_arguments_get_one_line_and_exit_code_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1


def test_python_dash_m_kvtier_is_the_same_cli():
    result = subprocess.run(
        [sys.executable, "-m", "kvtier", "--version"], capture_output=True, text=True, check=True
    )
    assert result.stdout.startswith("kvtier ")
