"""kvtier.bench.busy: the busy host the side-by-side benchmarks run beside each side."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.bench.busy import BusyHost


def busy_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("busy-host-")]


@pytest.mark.parametrize(
    ("share", "threads", "slice_s", "message"),
    [
        (-0.1, 1, 0.01, "share must be at least 0"),
        (0.5, 0, 0.01, "threads must be at least 1"),
        (1.5, 1, 0.01, "1 thread(s) cannot take 1.5 of a core"),
        (0.5, 1, 0.0, "slice_s must be positive"),
    ],
)
def test_impossible_loads_are_refused_by_name(share, threads, slice_s, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        BusyHost(share, threads, slice_s)


def test_a_quiet_host_starts_no_thread_and_takes_nothing():
    with BusyHost(0.0) as busy:
        assert not busy.active
        assert busy_threads() == []
    assert busy.measured_share == 0.0
    assert busy.cpu_s == 0.0


def test_its_threads_run_python_while_it_runs_and_are_gone_after():
    busy = BusyHost(1.0, threads=2)
    busy.start()
    try:
        assert busy.active
        assert len(busy_threads()) == 2
        # Their CPU time is what is measured: this thread sleeps until the process has
        # taken some (however slowly a loaded machine runs them).
        began, deadline = time.process_time(), time.monotonic() + 60
        while time.process_time() - began < 0.02 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        share = busy.stop()
    assert busy_threads() == []
    assert busy.cpu_s > 0
    assert share == pytest.approx(busy.measured_share)
    assert 0 < share <= 1.0 + 0.05  # two threads at half a core each: one core at most


def test_it_can_be_started_again_and_refuses_a_second_start_while_running():
    busy = BusyHost(0.2)
    busy.start()
    with pytest.raises(RuntimeError, match="running already"):
        busy.start()
    busy.stop()
    with busy:
        assert len(busy_threads()) == 1
    assert busy_threads() == []
