"""The shared region: layout, joining, lifetime, and behaviour across real processes."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import multiprocessing
import os
import signal
import stat
from pathlib import Path

import pytest
import region_procs
import torch

from kvtier import SharedOffloadRegion
from kvtier.config import PAGE_SIZE
from kvtier.errors import RegionError
from kvtier.region import _HEADER, _MAGIC, region_path

GEOMETRY = {"num_chunks": 6, "chunk_bytes": 2 * PAGE_SIZE, "column_bytes": 3000, "world_size": 2}
TIMEOUT_S = 60


def open_region(engine_id: str, rank: int | None, **overrides) -> SharedOffloadRegion:
    geometry = {**GEOMETRY, **overrides}
    return SharedOffloadRegion(engine_id, rank=rank, **geometry)


def test_scheduler_sees_rows_as_a_2d_memoryview(engine_id):
    with open_region(engine_id, None) as region:
        rows = region.rows
        assert rows.shape == (6, 2 * PAGE_SIZE)
        assert not rows.readonly
        assert len(region.primary_view[5]) == 2 * PAGE_SIZE


def test_primary_view_rows_are_the_region_rows(engine_id):
    with open_region(engine_id, None) as region:
        region.primary_view[3][:4] = b"abcd"
        assert region.rows.tobytes()[3 * 2 * PAGE_SIZE : 3 * 2 * PAGE_SIZE + 4] == b"abcd"
        with pytest.raises(IndexError):
            region.primary_view[6]


def test_a_row_is_in_use_while_anything_derived_from_it_is_referenced(engine_id):
    with open_region(engine_id, None) as region:
        view = region.primary_view
        row = view[2]
        tensor = torch.frombuffer(row[100:200], dtype=torch.uint8)
        del row
        assert view.in_use(2) and not view.in_use(1)
        del tensor
        assert not view.in_use(2)


def test_the_memory_range_covers_every_row_at_its_address(engine_id):
    with open_region(engine_id, None) as region:
        view = region.primary_view
        address, length = view.memory_range()
        assert length == 6 * 2 * PAGE_SIZE
        view[4][7:9] = b"hi"
        # Read back through the raw address, as a transfer engine would.
        assert ctypes.string_at(address + 4 * 2 * PAGE_SIZE + 7, 2) == b"hi"
        assert not view.in_use(0)  # the range takes no row


def test_worker_column_is_a_strided_view_of_its_rank(engine_id):
    scheduler = open_region(engine_id, None)
    worker = open_region(engine_id, 1)
    column = worker.worker_column()
    assert column.shape == (6, 3000)
    assert column.stride() == (2 * PAGE_SIZE, 1)
    column[2].fill_(9)
    row = scheduler.primary_view[2]
    assert bytes(row[3000:6000]) == b"\x09" * 3000
    assert bytes(row[0:3000]) == b"\x00" * 3000
    del column
    worker.close()
    scheduler.close()


def test_region_file_is_private_to_the_user(engine_id):
    with open_region(engine_id, None) as region:
        mode = stat.S_IMODE(os.stat(region.path).st_mode)
        assert mode == 0o600


def test_name_is_unlinked_once_every_process_has_mapped_it(engine_id):
    path = region_path(engine_id)
    scheduler = open_region(engine_id, None)
    worker0 = open_region(engine_id, 0)
    assert path.exists()
    worker1 = open_region(engine_id, 1)
    assert not path.exists()
    for region in (worker1, worker0, scheduler):
        region.close()


def test_close_unlinks_a_region_not_everyone_joined(engine_id):
    region = open_region(engine_id, None)
    assert region.path.exists()
    region.close()
    region.close()
    assert not region.path.exists()
    assert region.closed


def test_joining_with_another_layout_is_refused(engine_id):
    with open_region(engine_id, None), pytest.raises(RegionError, match="another layout"):
        open_region(engine_id, 0, num_chunks=7)


def test_every_rank_of_a_shared_column_maps_the_same_bytes(engine_id):
    with (
        open_region(engine_id, None, shared_column=True) as scheduler,
        open_region(engine_id, 0, shared_column=True) as rank0,
        open_region(engine_id, 1, shared_column=True) as rank1,
    ):
        rank1.worker_column()[2].fill_(7)
        assert bool((rank0.worker_column()[2] == 7).all())
        row = bytes(scheduler.primary_view[2])
        assert row[: rank0.column_bytes] == b"\x07" * rank0.column_bytes


def test_joining_a_shared_column_region_with_columns_per_rank_is_refused(engine_id):
    with (
        open_region(engine_id, None, shared_column=True),
        pytest.raises(RegionError, match=r"one shared 3000-byte column"),
    ):
        open_region(engine_id, 0)


def test_a_seat_cannot_be_taken_twice(engine_id):
    with (
        open_region(engine_id, None),
        pytest.raises(RegionError, match=r"scheduler .* has already joined"),
    ):
        open_region(engine_id, None)


def test_joining_waits_for_the_creator_then_times_out(engine_id):
    path = region_path(engine_id)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a live creator that never finishes
        header = _HEADER.pack(_MAGIC, 1, 2, 6, 2 * PAGE_SIZE, 3000, 0, 0)
        os.pwrite(fd, header, 0)
        with pytest.raises(RegionError, match="timed out waiting for the creator"):
            SharedOffloadRegion(engine_id, rank=0, join_timeout=0.2, **GEOMETRY)
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_region_larger_than_shared_memory_is_refused(engine_id):
    free = os.statvfs("/dev/shm")
    too_big = free.f_bavail * free.f_frsize * 2
    chunk = 1 << 30
    with pytest.raises(RegionError, match="free"):
        SharedOffloadRegion(
            engine_id,
            rank=None,
            num_chunks=too_big // chunk,
            chunk_bytes=chunk,
            column_bytes=chunk,
            world_size=1,
        )
    assert not region_path(engine_id).exists()


def test_invalid_layouts_are_rejected(engine_id):
    with pytest.raises(ValueError, match="multiple of the page size"):
        open_region(engine_id, None, chunk_bytes=PAGE_SIZE + 1)
    with pytest.raises(ValueError, match="do not fit"):
        open_region(engine_id, None, column_bytes=PAGE_SIZE + 1)
    with pytest.raises(ValueError, match="rank"):
        open_region(engine_id, 2)


def test_views_are_gone_after_close(engine_id):
    region = open_region(engine_id, None)
    region.close()
    with pytest.raises(RegionError, match="closed"):
        _ = region.primary_view


def mapped_by_this_process(region: SharedOffloadRegion) -> bool:
    return str(region.path) in Path("/proc/self/maps").read_text()


def test_close_unmaps_the_region(engine_id):
    region = open_region(engine_id, None)
    region.close()
    assert not region.mapped
    assert not mapped_by_this_process(region)


def test_a_region_a_row_view_keeps_mapped_says_so_at_warning_and_unmaps_with_the_view(
    engine_id, caplog
):
    region = open_region(engine_id, None)
    row = region.primary_view[3]
    with caplog.at_level(logging.WARNING, logger="kvtier.region"):
        region.close()
    assert region.mapped
    assert mapped_by_this_process(region)
    [record] = [r for r in caplog.records if r.name == "kvtier.region"]
    assert record.levelno == logging.WARNING
    assert "stays mapped" in record.getMessage()
    assert "1 row view(s) handed to tiers (slots 3)" in record.getMessage()
    assert "log record" in record.getMessage()
    del row
    assert not region.mapped
    assert not mapped_by_this_process(region)


# --------------------------------------------------------- real processes


def spawn():
    return multiprocessing.get_context("spawn")


def recv(conn, what):
    assert conn.poll(TIMEOUT_S), f"timed out waiting for {what}"
    return conn.recv()


def test_two_worker_processes_fill_their_columns_and_the_scheduler_sees_rows_interleaved(engine_id):
    ctx = spawn()
    sched_conn, sched_child = ctx.Pipe()
    scheduler = ctx.Process(target=region_procs.scheduler, args=(engine_id, GEOMETRY, sched_child))
    scheduler.start()
    assert recv(sched_conn, "scheduler") == "ready"
    workers, conns = [], []
    for rank in (0, 1):
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=region_procs.worker, args=(engine_id, rank, GEOMETRY, child))
        proc.start()
        workers.append(proc)
        conns.append(conn)
    for conn in conns:
        assert recv(conn, "worker") == "written"
    assert not region_path(engine_id).exists()  # everyone mapped it: the name is gone
    sched_conn.send("rows")
    rows = recv(sched_conn, "rows")
    column = GEOMETRY["column_bytes"]
    for chunk, row in enumerate(rows):
        assert row[:column] == bytes([region_procs.fill_value(0, chunk)]) * column
        assert row[column : 2 * column] == bytes([region_procs.fill_value(1, chunk)]) * column
        assert row[2 * column :] == b"\x00" * (len(row) - 2 * column)
    for conn in conns:
        conn.send("exit")
    sched_conn.send("exit")
    assert recv(sched_conn, "close") == "closed"
    for proc in [*workers, scheduler]:
        proc.join(TIMEOUT_S)
        assert proc.exitcode == 0


def shm_free() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def test_sigkilled_processes_leave_no_shared_memory_behind(engine_id):
    geometry = {
        **GEOMETRY,
        "num_chunks": 1024,
        "chunk_bytes": 16 * PAGE_SIZE,
        "column_bytes": 8 * PAGE_SIZE,
    }
    region_bytes = geometry["num_chunks"] * geometry["chunk_bytes"]
    ctx = spawn()
    sched_conn, sched_child = ctx.Pipe()
    scheduler = ctx.Process(target=region_procs.scheduler, args=(engine_id, geometry, sched_child))
    scheduler.start()
    assert recv(sched_conn, "scheduler") == "ready"
    procs, conns = [scheduler], [sched_conn]
    for rank in (0, 1):
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=region_procs.worker, args=(engine_id, rank, geometry, child))
        proc.start()
        procs.append(proc)
        conns.append(conn)
        assert recv(conn, "worker") == "written"
    in_use = shm_free()
    for proc in procs:
        os.kill(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.join(TIMEOUT_S)
        assert proc.exitcode == -signal.SIGKILL
    assert list(region_path(engine_id).parent.glob(f"kvtier_{engine_id}*")) == []
    # The pages went with the last mapping.
    assert shm_free() - in_use >= region_bytes // 2


def test_a_region_left_by_a_creator_killed_before_anyone_joined_is_reclaimed(engine_id, caplog):
    ctx = spawn()
    conn, child = ctx.Pipe()
    scheduler = ctx.Process(target=region_procs.scheduler, args=(engine_id, GEOMETRY, child))
    scheduler.start()
    assert recv(conn, "scheduler") == "ready"
    os.kill(scheduler.pid, signal.SIGKILL)
    scheduler.join(TIMEOUT_S)
    assert region_path(engine_id).exists()  # nobody else joined: the name stayed
    with caplog.at_level(logging.WARNING, logger="kvtier.region"):
        region = open_region(engine_id, None)
    assert "reclaiming" in caplog.text
    assert region.is_creator
    region.close()


def test_worker_column_tensor_writes_are_visible_to_torch_readers(engine_id):
    scheduler = open_region(engine_id, None)
    worker = open_region(engine_id, 0)
    column = worker.worker_column()
    column.copy_(
        torch.arange(6 * 3000, dtype=torch.int64).remainder(251).to(torch.uint8).view(6, 3000)
    )
    assert bytes(scheduler.primary_view[1][:3]) == bytes([3000 % 251, 3001 % 251, 3002 % 251])
    del column
    worker.close()
    scheduler.close()


def test_a_participant_leaving_early_keeps_the_name_for_the_others(engine_id):
    scheduler = open_region(engine_id, None)
    worker0 = open_region(engine_id, 0)
    worker0.close()
    assert region_path(engine_id).exists()
    worker1 = open_region(engine_id, 1)
    assert not worker1.is_creator
    worker1.close()
    scheduler.close()
    assert not region_path(engine_id).exists()


def test_a_joiner_that_fails_leaves_the_live_region_alone(engine_id):
    with open_region(engine_id, None):
        with pytest.raises(RegionError):
            open_region(engine_id, 0, column_bytes=2000)
        assert region_path(engine_id).exists()


def test_orphans_of_other_engines_are_swept_when_a_region_is_created(engine_id):
    ctx = spawn()
    orphan = f"{engine_id}-orphan"
    conn, child = ctx.Pipe()
    scheduler = ctx.Process(target=region_procs.scheduler, args=(orphan, GEOMETRY, child))
    scheduler.start()
    assert recv(conn, "scheduler") == "ready"
    live = open_region(f"{engine_id}-live", None)  # alive: must survive the sweep
    os.kill(scheduler.pid, signal.SIGKILL)
    scheduler.join(TIMEOUT_S)
    assert region_path(orphan).exists()
    with open_region(engine_id, None):
        assert not region_path(orphan).exists()
        assert region_path(f"{engine_id}-live").exists()
    live.close()
