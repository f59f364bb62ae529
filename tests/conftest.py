from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3_servers import ACCESS_KEY, SECRET_KEY, MotoServer

SHM_DIR = Path("/dev/shm")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine_id() -> Iterator[str]:
    """A fresh engine id; the test fails if it leaves its region's file behind."""
    engine = f"test-{uuid.uuid4().hex[:12]}"
    yield engine
    leftovers = sorted(p.name for p in SHM_DIR.glob(f"kvtier_{engine}*"))
    for name in leftovers:
        os.unlink(SHM_DIR / name)
    assert not leftovers, f"the test left {leftovers} in {SHM_DIR}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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
