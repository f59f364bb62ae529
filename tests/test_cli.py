import json
import subprocess
import sys

import pytest
from kvtier_cli import kvtier

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
        (["bench", "--json", "/no/such/dir/r.json"], "--json /no/such/dir/r.json: /no/such/dir"),
        (["bench", "--reuse-root"], "--reuse-root needs --root"),
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


# ------------------------------------------------- kvtier plan, the real command

TIERING = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20}


def plan(tmp_path, extra: dict, *args: str):
    config = tmp_path / "extra.json"
    config.write_text(json.dumps({**TIERING, **extra}))
    return kvtier("plan", "--kv-bytes-per-block", "131072", "--config", str(config), *args)


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        pytest.param(
            {"type": "fs", "root_dir": "/tmp/kv", "capacty_bytes": 5},
            "secondary_tiers[0].capacty_bytes: unknown setting; did you mean 'capacity_bytes'?",
            id="fs-typo",
        ),
        pytest.param({"type": "fs"}, "secondary_tiers[0].root_dir: is required", id="fs-no-root"),
        pytest.param(
            {"type": "p2p"},
            "secondary_tiers[0].secret: exactly one of secret or secret_file is required",
            id="p2p-no-secret",
        ),
    ],
)
def test_plan_refuses_a_tier_the_engine_would_refuse(tmp_path, tier, message):
    result = plan(tmp_path, {"secondary_tiers": [tier]})
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("kvtier: error: ") and result.stderr.count("\n") == 1
    assert message in result.stderr


def test_plan_lists_every_tier_with_the_settings_the_engine_will_use(tmp_path):
    tiers = [
        {"type": "fs", "root_dir": "~/kv", "io_concurrency": 2, "job_timeout_s": 12},
        {"type": "p2p", "name": "peers", "secret": "a-secret-of-twenty-bytes"},
        {"type": "s3", "bucket": "kv-cache", "access_key_id": "AKID", "secret_access_key": "SK"},
    ]
    result = plan(tmp_path, {"secondary_tiers": tiers}, "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)["tiers"]
    assert [tier["label"] for tier in listed] == ["1:fs", "2:peers", "3:s3"]
    fs, p2p, s3 = listed
    # Defaults filled in and io_concurrency resolved, as FsSettings reads them.
    assert fs["settings"]["read_depth"] == fs["settings"]["write_depth"] == 2
    assert fs["settings"]["o_direct"] == "auto" and fs["job_timeout_s"] == 12
    assert fs["locality"] == "local" and p2p["locality"] == "remote"
    assert p2p["settings"]["secret"] == "<hidden>"
    assert s3["settings"]["secret_access_key"] == s3["settings"]["access_key_id"] == "<hidden>"
    assert "a-secret-of-twenty-bytes" not in result.stdout and "AKID" not in result.stdout

    text = plan(tmp_path, {"secondary_tiers": tiers})
    assert text.returncode == 0, text.stderr
    assert "tier 1:fs  kvtier.tiers.fs.FileSystemTier (local)" in text.stdout
    assert "tier 3:s3  kvtier.tiers.s3.tier.S3Tier (remote)" in text.stdout
    assert "a-secret-of-twenty-bytes" not in text.stdout


def test_plan_of_the_cpu_spec_says_there_are_no_secondary_tiers():
    result = kvtier("plan", "--kv-bytes-per-block", "4096", "--set", "cpu_bytes_to_use=65536")
    assert result.returncode == 0, result.stderr
    assert "tiers             none (the primary tier only)" in result.stdout
