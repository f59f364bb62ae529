"""The ``kvtier`` command imports only what the command it runs needs: help, ``plan``
and ``inspect`` touch no tensor, so none of them imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import keys

from kvtier.format import ChunkFormat, NamespaceDescription, chunk_path, namespace_directory

#: Runs ``kvtier ARGV`` as the console script does (``kvtier.cli:main``) in a fresh
#: interpreter, then writes the names of the modules it imported to a file.
_RUN_AND_LIST_MODULES = """
import json, sys
argv, listing = json.loads(sys.argv[1]), sys.argv[2]
from kvtier.cli import main
try:
    code = main(argv)
except SystemExit as exc:
    code = exc.code
with open(listing, "w") as out:
    json.dump({"code": code, "modules": sorted(sys.modules)}, out)
"""


def modules_imported_by(tmp_path: Path, *argv: str) -> tuple[int, set[str]]:
    """The exit code of ``kvtier ARGV`` and the top-level modules it imported."""
    listing = tmp_path / "modules.json"
    subprocess.run(
        [sys.executable, "-c", _RUN_AND_LIST_MODULES, json.dumps(argv), str(listing)],
        check=True,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    result = json.loads(listing.read_text())
    return result["code"], {name.split(".")[0] for name in result["modules"]}


def an_fs_root(root: Path) -> Path:
    """An fs tier's root_dir holding one namespace of one sound chunk."""
    namespace = "kvtier/v1;model=m;dtype=bf16;tokens=16;world=1;column=4096;chunk=4096"
    chunk_format = ChunkFormat(namespace)
    directory = root / namespace_directory("m", chunk_format)
    directory.mkdir(parents=True)
    (directory / "namespace.json").write_text(NamespaceDescription(namespace, 4096, "m").to_json())
    row = bytes(range(256)) * 16
    [key] = keys("imports", 1)
    path = directory / chunk_path(key)
    path.parent.mkdir()
    path.write_bytes(bytes(chunk_format.header(key, memoryview(row))) + row)
    return root


_TIERS = json.dumps(
    [
        {"type": "fs", "root_dir": "/tmp/kvtier-plan-imports"},
        {"type": "s3", "bucket": "kv", "endpoint_url": "http://127.0.0.1:9"},
        {"type": "p2p", "listen": "127.0.0.1:0", "secret": "s" * 32},
    ]
)


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--help"], id="help"),
        pytest.param(["--version"], id="version"),
        pytest.param(["plan", "--help"], id="plan-help"),
        pytest.param(["inspect", "--help"], id="inspect-help"),
        pytest.param(["bench", "--help"], id="bench-help"),
        pytest.param(
            ["plan", "--kv-bytes-per-block", "131072", "--set", "cpu_bytes_to_use=1048576"],
            id="plan",
        ),
        pytest.param(
            [
                "plan",
                "--kv-bytes-per-block",
                "131072",
                "--json",
                "--set",
                "cpu_bytes_to_use=1048576",
                "--set",
                f"secondary_tiers={_TIERS}",
            ],
            id="plan-with-fs-s3-p2p-tiers",
        ),
        pytest.param(["inspect", "--verify", "ROOT"], id="inspect-verify"),
    ],
)
def test_a_command_without_tensors_never_imports_torch(tmp_path, argv):
    argv = [str(an_fs_root(tmp_path / "root")) if arg == "ROOT" else arg for arg in argv]
    code, modules = modules_imported_by(tmp_path, *argv)
    assert code in (0, None), f"kvtier {' '.join(argv)} exited {code}"
    assert "torch" not in modules, f"kvtier {' '.join(argv)} imported torch"


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"]], ids=["help", "bench-help"])
def test_help_imports_no_cloud_client_and_no_terminal_library(tmp_path, argv):
    _, modules = modules_imported_by(tmp_path, *argv)
    assert not modules & {"aiobotocore", "botocore", "aiohttp", "rich", "matplotlib"}


def test_the_listing_sees_torch_where_a_command_imports_it(tmp_path):
    """The checks above can fail: ``bench`` imports its replay, and torch with it, to
    check its options (here refusing one)."""
    code, modules = modules_imported_by(tmp_path, "bench", "--tiers", "tape")
    assert code == 2
    assert "torch" in modules
