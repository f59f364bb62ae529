"""A recurring failure is logged once, then counted."""

from __future__ import annotations

import logging

from kvtier._logs import ThrottledLog, describe_error

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
