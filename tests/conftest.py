from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

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
