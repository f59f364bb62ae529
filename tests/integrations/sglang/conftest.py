"""SGLang's real HiCache controllers storing into kvtier, on the CPU.

Everything here needs SGLang 0.5.23 (``nox -s sglang``); without it the whole directory
is skipped. ``benchmarks/sglang_host.py`` builds the controllers and plays the
scheduler's part.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

# The module, not the name alone: a directory called sglang on sys.path would do for that.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch
from sglang_host import Geometry, HiCacheHost, configure_process
from sglang_procs import PREFETCH_TIMEOUTS

# One intra-op thread: the pages are small, and torch's spinning worker threads would
# take the small test machine's cores from the controller's and kvtier's threads.
torch.set_num_threads(1)

SHM_DIR = Path("/dev/shm")

configure_process(Geometry().page_tokens, storage_extra_config=PREFETCH_TIMEOUTS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.sglang)


@pytest.fixture
def hosts() -> Iterator[list[HiCacheHost]]:
    """Hosts a test opens; each is detached (its backend closed) when the test ends,
    and no kvtier region may be left in /dev/shm."""
    before = {p.name for p in SHM_DIR.glob("kvtier_sglang-*")}
    opened: list[HiCacheHost] = []
    yield opened
    for host in opened:
        host.close()
    left = {p.name for p in SHM_DIR.glob("kvtier_sglang-*")} - before
    assert not left, f"the test left {sorted(left)} in {SHM_DIR}"


@pytest.fixture
def tokens_of():
    """Token ids of ``pages`` whole pages, unique to the call unless ``prefix`` is given."""

    def make(pages: int, page_tokens: int, *, prefix: list[int] | None = None) -> list[int]:
        start = (prefix or [])[:]
        base = uuid.uuid4().int % 1_000_000 * 1000
        return start + [base + i for i in range(pages * page_tokens - len(start))]

    return make
