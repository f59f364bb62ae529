"""Process bodies for the multi-process region tests (imported by spawned children)."""

from __future__ import annotations

from multiprocessing.connection import Connection

from kvtier import SharedOffloadRegion

TIMEOUT_S = 60


def open_side(engine_id: str, rank: int | None, geometry: dict[str, int]) -> SharedOffloadRegion:
    return SharedOffloadRegion(engine_id, rank=rank, **geometry)


def fill_value(rank: int, chunk: int) -> int:
    return (rank * 64 + chunk * 7 + 1) % 256


def scheduler(engine_id: str, geometry: dict[str, int], conn: Connection) -> None:
    region = open_side(engine_id, None, geometry)
    conn.send("ready")
    while conn.poll(TIMEOUT_S):
        message = conn.recv()
        if message == "rows":
            conn.send([bytes(row) for row in region.primary_view])
        elif message == "exit":
            break
    region.close()
    conn.send("closed")


def worker(engine_id: str, rank: int, geometry: dict[str, int], conn: Connection) -> None:
    region = open_side(engine_id, rank, geometry)
    column = region.worker_column()
    for chunk in range(region.num_chunks):
        column[chunk].fill_(fill_value(rank, chunk))
    conn.send("written")
    if conn.poll(TIMEOUT_S):
        conn.recv()
    del column
    region.close()
