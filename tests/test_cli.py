import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import keys
from kvtier_cli import KVTIER, kvtier
from vllm_keys import vllm_tiering_config

from kvtier.cli import main
from kvtier.format import ChunkFormat, NamespaceDescription, chunk_path, namespace_directory
from kvtier.tiering.runner import RunnerSettings
from kvtier.tiers.fs import FsSettings
from kvtier.tiers.p2p import PeerSettings
from kvtier.tiers.s3 import S3Settings


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
        pytest.param(
            {"type": "s3", "bucket": "kv-cache", "job_deadline_s": 30},
            "secondary_tiers[0].job_deadline_s: must be below the tier's job_timeout_s (30 s)",
            id="s3-deadline-past-the-job-timeout",
        ),
        pytest.param(
            {"type": "p2p", "secret": "a-secret-of-twenty-bytes", "max_frame_bytes": 70000},
            "secondary_tiers[0].max_frame_bytes: expected a value >= ",
            id="p2p-frame-limit-below-a-chunk",
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
    assert "tier 1:fs  kvtier.tiers.fs.tier.FileSystemTier (local)" in text.stdout
    assert "tier 3:s3  kvtier.tiers.s3.tier.S3Tier (remote)" in text.stdout
    assert "a-secret-of-twenty-bytes" not in text.stdout


def test_plan_of_the_cpu_spec_says_there_are_no_secondary_tiers():
    result = kvtier("plan", "--kv-bytes-per-block", "4096", "--set", "cpu_bytes_to_use=65536")
    assert result.returncode == 0, result.stderr
    assert re.search(r"^tiers +none \(the primary tier only\)$", result.stdout, re.MULTILINE)


def fields_of(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_plan_shows_every_effective_value_defaults_included(tmp_path):
    tiers = [
        {"type": "fs", "root_dir": "/data/kv"},
        {"type": "p2p", "secret": "a-secret-of-twenty-bytes"},
        {"type": "s3", "bucket": "kv-cache", "job_timeout_s": 12},
    ]
    result = plan(tmp_path, {"secondary_tiers": tiers}, "--json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["offload_prompt_only"] is True and shown["store_threshold"] == 0
    assert shown["block_size"] == 16 and shown["eviction_policy"] == "lru"
    assert shown["cpu_bytes_to_use"] == 1 << 20 and shown["backpressure"] is None
    fs, p2p, s3 = shown["tiers"]
    for tier in (fs, p2p, s3):
        assert fields_of(RunnerSettings) <= set(tier)
        assert tier["max_concurrent_jobs"] == 8 and tier["lookup_timeout_s"] == 5.0
    # A local tier promotes a bounded number of chunks at once, a remote one does not.
    assert (fs["max_promotion_chunks"], p2p["max_promotion_chunks"]) == (32, None)
    for tier, settings_class in ((fs, FsSettings), (p2p, PeerSettings), (s3, S3Settings)):
        assert set(tier["settings"]) == fields_of(settings_class)
    # What each tier derives when it is built, not the null that stands for "derive it":
    # s3 ends its requests at 2/3 of its job timeout, p2p takes one chunk frame + 64 KiB.
    assert s3["settings"]["job_deadline_s"] == pytest.approx(8.0)
    assert p2p["settings"]["max_frame_bytes"] > 131072 + 64 * 1024

    text = plan(tmp_path, {"secondary_tiers": tiers})
    assert text.returncode == 0, text.stderr
    for row in ("max_promotion_chunks +32", "job_deadline_s +8.0", "max_frame_bytes +2\\d\\d,"):
        assert re.search(rf"^  {row}", text.stdout, re.MULTILINE), row
    assert re.search(r"^offload_prompt_only +true$", text.stdout, re.MULTILINE)


def test_plan_shows_a_secret_that_is_not_set_as_not_set(tmp_path):
    tier = {"type": "s3", "bucket": "kv-cache", "access_key_id": "AKID", "secret_access_key": "SK"}
    result = plan(tmp_path, {"secondary_tiers": [tier]}, "--json")
    assert result.returncode == 0, result.stderr
    [s3] = json.loads(result.stdout)["tiers"]
    assert s3["settings"]["access_key_id"] == s3["settings"]["secret_access_key"] == "<hidden>"
    assert s3["settings"]["session_token"] is None

    text = plan(tmp_path, {"secondary_tiers": [tier]})
    assert re.search(r"^  session_token +not set$", text.stdout, re.MULTILINE)
    assert re.search(r"^  access_key_id +<hidden>$", text.stdout, re.MULTILINE)


def test_plan_shows_a_remote_locality_and_its_water_marks(tmp_path):
    tier = {"type": "fs", "root_dir": "/nfs/kv", "locality": "remote", "backpressure": {}}
    result = plan(tmp_path, {"secondary_tiers": [tier]}, "--json")
    assert result.returncode == 0, result.stderr
    [fs] = json.loads(result.stdout)["tiers"]
    assert fs["locality"] == "remote" and fs["max_promotion_chunks"] is None
    assert (fs["backpressure"]["high_water"], fs["backpressure"]["low_water"]) == (0.020, 0.005)


def write_extra(tmp_path, extra: dict):
    path = tmp_path / "extra.json"
    path.write_text(json.dumps(extra))
    return str(path)


def test_plan_and_bench_read_a_file_with_tiers_and_no_spec_name_alike(tmp_path):
    tier = {"type": "fs", "root_dir": str(tmp_path / "kv")}
    good = write_extra(tmp_path, {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]})
    planned = kvtier("plan", "--kv-bytes-per-block", "131072", "--config", good, "--json")
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["spec"] == "TieringOffloadingSpec"
    # (That kvtier bench runs with such a file: tests/bench/test_cli.py.)

    bad = write_extra(tmp_path, {"secondary_tiers": [{**tier, "capacty_bytes": 5}]})
    answers = [
        kvtier("plan", "--kv-bytes-per-block", "131072", "--set", "cpu_bytes_to_use=1048576",
               "--config", bad),
        kvtier("bench", "--config", bad),
    ]  # fmt: skip
    for answer in answers:
        assert answer.returncode == 2 and answer.stdout == ""
    assert answers[0].stderr == answers[1].stderr
    assert answers[0].stderr.startswith(
        "kvtier: error: secondary_tiers[0].capacty_bytes: unknown setting; "
        "did you mean 'capacity_bytes'?"
    )
    assert not (tmp_path / "kv").exists()


# ------------------------------------------------------ kvtier inspect, and its readers


def a_cache(root):
    """An fs tier's root_dir holding one namespace of two sound chunks."""
    namespace = "kvtier/v1;model=m;dtype=bf16;tokens=16;world=1;column=4096;chunk=4096"
    chunk_format = ChunkFormat(namespace)
    directory = root / namespace_directory("m", chunk_format)
    directory.mkdir(parents=True)
    (directory / "namespace.json").write_text(NamespaceDescription(namespace, 4096, "m").to_json())
    row = bytes(range(256)) * 16
    for key in keys("cli", 2):
        path = directory / chunk_path(key)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(bytes(chunk_format.header(key, memoryview(row))) + row)
    return root


@pytest.mark.parametrize("json_flag", [(), ("--json",)], ids=["text", "json"])
def test_inspect_of_a_directory_holding_no_cache_fails_in_one_line(tmp_path, json_flag):
    (tmp_path / "notes.txt").write_text("not a cache")
    result = kvtier("inspect", str(tmp_path), *json_flag)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"kvtier: error: {tmp_path}: no kvtier cache")


def test_inspect_of_a_cache_lists_it_and_exits_0(tmp_path):
    result = kvtier("inspect", str(a_cache(tmp_path)), "--verify", "--json")
    assert result.returncode == 0, result.stderr
    [namespace] = json.loads(result.stdout)
    assert namespace["chunks"] == namespace["verified"] == 2


def into_a_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``kvtier ARGS`` with stdout a pipe whose reader is gone: ``| head`` at its
    most abrupt, the reader leaving before the first line."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [KVTIER, *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=110,
            check=False,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "command",
    [
        ["plan", "--kv-bytes-per-block", "4096", "--set", "cpu_bytes_to_use=65536", "--json"],
        ["plan", "--kv-bytes-per-block", "4096", "--set", "cpu_bytes_to_use=65536"],
        ["inspect", "{cache}"],
        ["inspect", "{cache}", "--verify", "--json"],
    ],
    ids=["plan-json", "plan", "inspect", "inspect-json"],
)
def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path, command):
    cache = a_cache(tmp_path / "cache")
    result = into_a_closed_pipe(*(arg.format(cache=cache) for arg in command))
    # No traceback, nothing at all on stderr; the exit code a shell gives a process
    # ended by SIGPIPE (as `yes | head` does), not 1, which means bad chunks.
    assert result.stderr == ""
    assert result.returncode == 128 + signal.SIGPIPE


# ---------------------------------------- a configuration written for vLLM, checked by plan

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_vllm_extra_config() -> dict:
    """The kv_connector_extra_config of the README's `vllm serve` example, as written."""
    text = README.read_text()
    transfer = re.search(r"--kv-transfer-config '(\{.*?\})'", text, re.DOTALL)
    assert transfer, "the README's vllm serve example is gone"
    extra: dict = json.loads(transfer.group(1))["kv_connector_extra_config"]
    return extra


def plan_of(tmp_path, extra: dict, *args: str):
    config = tmp_path / "vllm-extra.json"
    config.write_text(json.dumps(extra))
    return kvtier("plan", "--kv-bytes-per-block", "131072", "--config", str(config), *args)


def test_plan_checks_the_readme_vllm_configuration_as_the_adapter_reads_it(tmp_path):
    extra = readme_vllm_extra_config()
    assert extra["spec_module_path"] == "kvtier.integrations.vllm"
    result = plan_of(tmp_path, extra, "--json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["vllm_spec"] == "kvtier.integrations.vllm.KVTierOffloadingSpec"
    assert shown["spec"] == "TieringOffloadingSpec"
    # vLLM's blocks_per_chunk is the chunk; the fs tier's thread counts are its depths.
    assert shown["blocks_per_chunk"] == extra["blocks_per_chunk"]
    assert shown["block_size"] == 16 * extra["blocks_per_chunk"]
    assert shown["vllm_keys"] == {"blocks_per_chunk": extra["blocks_per_chunk"]}
    [fs] = shown["tiers"]
    [written] = extra["secondary_tiers"]
    assert fs["settings"]["read_depth"] == written["n_read_threads"]
    assert fs["settings"]["write_depth"] == written["n_write_threads"]
    assert fs["settings"]["root_dir"] == written["root_dir"]

    text = plan_of(tmp_path, extra)
    assert text.returncode == 0, text.stderr
    assert re.search(
        r"^vllm_spec +kvtier\.integrations\.vllm\.KVTierOffloadingSpec$", text.stdout, re.M
    )


def test_plan_shows_how_each_key_of_vllms_tiering_spec_was_read(tmp_path):
    extra = vllm_tiering_config(str(tmp_path / "fs"), endpoint="minio.internal:9000")
    result = plan_of(tmp_path, extra, "--json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    readings = shown["vllm_readings"]
    for reading in [
        "tier_poll_interval_s -> not used: kvtier's tiers run on their own event loop",
        "max_tracker_size -> max_tracked_lookups = 32000",
        "backpressure.backpressure_cls -> kvtier's detector (vLLM's EMABackpressureDetector)",
        "backpressure.policy_cls -> backpressure.policy = throttled",
        "backpressure -> merged field by field under each tier's own backpressure",
        "secondary_tiers[0].max_bytes -> secondary_tiers[0].capacity_bytes = 1073741824",
        "secondary_tiers[0].backpressure.high_water_s -> secondary_tiers[0].backpressure."
        "high_water = 0.02",
        "secondary_tiers[0].backpressure.warmup_completions -> secondary_tiers[0].backpressure."
        "warmup = 5",
        "secondary_tiers[1].store_config.endpoint_override -> secondary_tiers[1].endpoint_url = "
        "http://minio.internal:9000",
        "secondary_tiers[1].store_config.access_key -> secondary_tiers[1].access_key_id = <hidden>",
        "secondary_tiers[1].io_threads -> secondary_tiers[1].max_concurrency = 8",
        "secondary_tiers[1].locality -> secondary_tiers[1].locality = remote",
        "secondary_tiers[1].enable_kv_events -> secondary_tiers[1].enable_kv_events = False: "
        "this tier reports no events",
        "secondary_tiers[1].backpressure -> vLLM's EMABackpressureDetector defaults for a remote "
        "storage tier where not set: high_water = 0.05, low_water = 0.01, warmup = 10, "
        "failure_threshold = 3",
    ]:
        assert any(line.startswith(reading) for line in readings), reading
    fs, obj = shown["tiers"]
    assert fs["settings"]["capacity_bytes"] == 1 << 30 and fs["enable_kv_events"] is True
    assert obj["settings"]["endpoint_url"] == "http://minio.internal:9000"
    assert obj["backpressure"]["failure_threshold"] == 3

    text = plan_of(tmp_path, extra)
    assert text.returncode == 0, text.stderr
    assert "\nvLLM keys read as\n  tier_poll_interval_s -> not used" in text.stdout
    for answer in (result, text):
        assert "AKIDVLLMKEYS" not in answer.stdout
        assert "vllm-secret-key-never-shown" not in answer.stdout


def test_plan_never_imports_vllm_to_check_a_vllm_configuration(tmp_path):
    config = tmp_path / "vllm-extra.json"
    config.write_text(json.dumps(readme_vllm_extra_config()))
    argv = ["plan", "--kv-bytes-per-block", "131072", "--config", str(config)]
    # Whether vLLM is installed or not, plan reads the file without it.
    code = (
        "import sys\nfrom kvtier.cli import main\n"
        f"assert main({argv!r}) == 0\n"
        "assert 'vllm' not in sys.modules, 'plan imported vLLM'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param(
            {"spec_name": "TieringOffloadingSpec", "spec_module_path": None},
            "secondary_tiers[0].n_read_threads: unknown setting: vLLM's name for the fs tier's "
            "read_depth, which TieringOffloadingSpec does not read: for vLLM, name kvtier's "
            "adapter (spec_name KVTierOffloadingSpec, spec_module_path kvtier.integrations.vllm)",
            id="vllm-keys-under-kvtier-s-own-spec",
        ),
        pytest.param(
            {"spec_name": "TieringOffloadingSpec", "spec_module_path": None, "secondary_tiers": []},
            "blocks_per_chunk: unknown setting: a key of vLLM's kv_connector_extra_config, which "
            "TieringOffloadingSpec does not read",
            id="blocks-per-chunk-under-kvtier-s-own-spec",
        ),
        pytest.param(
            {
                "spec_name": "TieringOffloadingSpec",
                "spec_module_path": None,
                "secondary_tiers": [],
                "backpressure": {"high_water_s": 0.02},
            },
            "backpressure.high_water_s: unknown setting: vLLM's name for back-pressure's "
            "high_water, which TieringOffloadingSpec does not read: for vLLM, name kvtier's "
            "adapter",
            id="vllm-backpressure-key-under-kvtier-s-own-spec",
        ),
        pytest.param(
            {"block_size": 64},
            "blocks_per_chunk: 2 blocks of 16 tokens make 32-token chunks, but block_size says 64",
            id="two-chunk-sizes",
        ),
    ],
)
def test_plan_and_bench_refuse_a_vllm_configuration_saying_where_a_key_belongs(
    tmp_path, change, message
):
    extra = {**readme_vllm_extra_config(), **change}
    extra = {key: value for key, value in extra.items() if value is not None}
    config = tmp_path / "vllm-extra.json"
    config.write_text(json.dumps(extra))
    planned = kvtier("plan", "--kv-bytes-per-block", "131072", "--config", str(config))
    benched = kvtier("bench", "--config", str(config))
    for answer in (planned, benched):
        assert answer.returncode == 2 and answer.stdout == ""
        assert answer.stderr.count("\n") == 1
    assert planned.stderr.startswith(f"kvtier: error: {message}")
    assert benched.stderr == planned.stderr
