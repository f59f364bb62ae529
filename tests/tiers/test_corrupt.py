"""What a tier does with stored chunks that failed verification."""

from __future__ import annotations

import logging

import pytest
from helpers import keys

from kvtier.format import chunk_name
from kvtier.keys import OffloadKey
from kvtier.tiers.base import TierContext
from kvtier.tiers.kit import CorruptChunks, ThrottledLog

pytestmark = pytest.mark.anyio

NAMESPACE = "kvtier/v1;model=m;dtype=bf16;tokens=16;world=1;column=4096;chunk=4096"
logger = logging.getLogger("kvtier.tests.corrupt")


class Removals:
    """A remover that records what it was asked to remove and removes ``keep`` not."""

    def __init__(self, keep: set[OffloadKey] | None = None) -> None:
        self.asked: list[list[OffloadKey]] = []
        self.keep = keep or set()

    async def __call__(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        self.asked.append(list(keys))
        return [key for key in keys if key not in self.keep]


def corrupt_chunks() -> tuple[CorruptChunks, TierContext]:
    # No slot is read or written: the context only counts.
    ctx = TierContext(primary_view=None, chunk_bytes=4096, namespace=NAMESPACE, tier_name="1:fs")
    log = ThrottledLog(logger, "tier 1:fs", interval_s=3600)
    return CorruptChunks(ctx, log, lambda key: f"/cache/{chunk_name(key)}"), ctx


async def test_corrupt_chunks_are_counted_removed_and_reported_in_one_line(caplog):
    caplog.set_level(logging.WARNING, logger=logger.name)
    chunks, ctx = corrupt_chunks()
    first, second = keys("corrupt", 2)
    remove = Removals()
    problems = {first: "payload checksum mismatch", second: "truncated file"}
    assert await chunks.discard(problems, "promotion job 7", remove) == [first, second]
    assert ctx.counters.integrity_failures == 2
    assert remove.asked == [[first, second]]
    assert [r.getMessage() for r in caplog.records] == [
        "tier 1:fs: 2 stored chunk(s) failed verification during promotion job 7 "
        f"(payload checksum mismatch, truncated file), e.g. /cache/{chunk_name(first)}; "
        "2 removed, never served"
    ]


async def test_corrupt_chunks_found_again_soon_are_counted_but_not_logged_again(caplog):
    caplog.set_level(logging.WARNING, logger=logger.name)
    chunks, ctx = corrupt_chunks()
    for i, key in enumerate(keys("again", 3)):
        await chunks.discard({key: "foreign namespace"}, f"promotion job {i}", Removals())
    assert ctx.counters.integrity_failures == 3
    assert len(caplog.records) == 1


async def test_a_chunk_that_could_not_be_removed_still_counts(caplog):
    caplog.set_level(logging.WARNING, logger=logger.name)
    chunks, ctx = corrupt_chunks()
    [key] = keys("stuck", 1)
    assert await chunks.discard({key: "another key"}, "a lookup", Removals(keep={key})) == []
    assert ctx.counters.integrity_failures == 1
    assert "0 removed, never served" in caplog.records[0].getMessage()


async def test_nothing_corrupt_counts_removes_and_logs_nothing(caplog):
    caplog.set_level(logging.WARNING, logger=logger.name)
    chunks, ctx = corrupt_chunks()
    remove = Removals()
    assert await chunks.discard({}, "a lookup", remove) == []
    assert (ctx.counters.integrity_failures, remove.asked, caplog.records) == (0, [], [])
