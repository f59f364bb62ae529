"""A recurring failure is logged once, then counted; a failure reaches a record as text,
keeping nothing its frames held alive."""

from __future__ import annotations

import errno
import logging
import os
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import keys, store_all, tiering_config

from kvtier import KVTier
from kvtier._logs import ThrottledLog, describe_error, describe_failure
from kvtier.tiers.fs import FileSystemTier

logger = logging.getLogger("kvtier.test.logs")


def test_repeats_within_the_interval_are_held_back_and_counted(caplog):
    log = ThrottledLog(logger, "tier 1:fs", interval_s=3600)
    for job in range(3):
        log.warning("timeout", "job %d timed out", job)
    log.warning("other", "something else")
    assert [r.getMessage() for r in caplog.records] == [
        "tier 1:fs: job 0 timed out",
        "tier 1:fs: something else",
    ]


def test_the_next_report_after_the_interval_carries_the_count(caplog):
    now = [0.0]
    log = ThrottledLog(logger, "tier 2:s3", interval_s=10.0, clock=lambda: now[0])
    log.warning("timeout", "slow")
    now[0] = 5.0
    log.warning("timeout", "slow")
    log.warning("timeout", "slow")
    now[0] = 10.0
    log.warning("timeout", "slow")
    assert [r.getMessage() for r in caplog.records] == [
        "tier 2:s3: slow",
        "tier 2:s3: slow (2 more like it since the last report)",
    ]


def test_describe_error_is_one_line_with_the_type():
    assert describe_error(TimeoutError()) == "timed out"
    assert describe_error(ConnectionResetError("peer went away")) == (
        "ConnectionResetError: peer went away"
    )
    assert describe_error(EOFError()) == "EOFError"


class Row:
    """Stands for a row of the region: something a failing frame holds."""


def write(row: Row) -> None:
    raise OSError(errno.EIO, "the disk went away")


def test_a_failure_is_logged_as_text_with_its_traceback_and_no_exc_info(caplog):
    log = ThrottledLog(logger, "tier 1:fs")
    try:
        write(Row())
    except OSError as exc:
        log.warning("store failure", "store job %d failed", 7, error=exc)
    [record] = caplog.records
    assert record.exc_info is None
    first, *rest = record.getMessage().splitlines()
    assert first == "tier 1:fs: store job 7 failed: OSError: [Errno 5] the disk went away"
    assert rest[0] == "Traceback (most recent call last):"
    assert any("in write" in line for line in rest)


def test_a_logged_failure_lets_go_of_what_its_frames_held():
    row = Row()
    alive = weakref.ref(row)
    try:
        write(row)
    except OSError as exc:
        failure = exc
    del row
    assert alive() is not None  # the traceback's frame of write() holds it
    describe_failure(failure)
    assert alive() is None
    assert failure.__traceback__ is not None  # the frames stay, without their locals


def test_frames_of_a_chained_exception_let_go_too():
    row = Row()
    alive = weakref.ref(row)
    try:
        try:
            write(row)
        except OSError as exc:
            raise RuntimeError("the store failed") from exc
    except RuntimeError as exc:
        failure = exc
    del row
    assert "the disk went away" in describe_failure(failure)
    assert alive() is None


# ------------------------------------------------- failures kept by a log handler


class NoSpaceTier(FileSystemTier):
    """An fs tier on a full disk: every write syscall fails with ENOSPC."""

    @staticmethod
    def _pwritev(fd, buffers, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class KeptRecords(logging.Handler):
    """Keeps every record, as pytest's capture, a MemoryHandler or an error tracker do."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def kept_records() -> Iterator[KeptRecords]:
    handler = KeptRecords()
    library = logging.getLogger("kvtier")
    library.addHandler(handler)
    try:
        yield handler
    finally:
        library.removeHandler(handler)


def mapped(path: Path) -> bool:
    """Whether this process still maps ``path`` (deleted or not)."""
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.mark.anyio
async def test_a_store_failure_kept_by_a_log_handler_does_not_keep_the_region_mapped(
    engine_id, tmp_path, kept_records
):
    config = tiering_config(
        engine_id,
        [{"type": "NoSpaceTier", "module_path": __name__, "root_dir": str(tmp_path)}],
        chunks=4,
    )
    kv_cache = torch.zeros((16, 4096), dtype=torch.uint8)
    async with KVTier(config, [kv_cache]) as kv:
        region = kv.manager.region
        await store_all(kv, keys("full-disk", 4))
    failures = [r for r in kept_records.records if "failed" in r.getMessage()]
    assert failures, "the failed cascade was not logged"
    assert region.closed and not region.mapped
    assert not mapped(region.path)
    for record in failures:
        assert record.exc_info is None
        text = record.getMessage()
        assert "Traceback (most recent call last)" in text
        assert "No space left on device" in text
        assert '  File "' in text  # the frames, as text
