"""Resources close once; task sets own their tasks; Once runs once."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.resources import AsyncResource, Once, TaskSet, resolve_threadsafe

pytestmark = pytest.mark.anyio


class Counted(AsyncResource):
    def __init__(self) -> None:
        self.closes = 0

    async def aclose(self) -> None:
        self.closes += 1


async def test_async_with_closes_the_resource_on_the_way_out_even_on_error():
    resource = Counted()
    with pytest.raises(KeyError):
        async with resource as entered:
            assert entered is resource
            raise KeyError("boom")
    assert resource.closes == 1


async def test_task_set_wait_covers_tasks_spawned_while_waiting():
    tasks = TaskSet("test")
    finished: list[str] = []

    async def second() -> None:
        await asyncio.sleep(0)
        finished.append("second")

    async def first() -> None:
        await asyncio.sleep(0)
        tasks.spawn(second())
        finished.append("first")

    tasks.spawn(first())
    assert await tasks.wait()
    assert finished == ["first", "second"]
    assert not tasks


async def test_task_set_wait_gives_up_at_its_timeout_and_aclose_cancels():
    tasks = TaskSet("test")
    never = asyncio.Event()
    task = tasks.spawn(never.wait())
    assert not await tasks.wait(timeout=0.01)
    assert len(tasks) == 1
    assert await tasks.aclose()
    assert task.cancelled() and not tasks


async def test_task_set_logs_a_failed_task_once_unless_told_not_to(caplog):
    async def fail() -> None:
        raise ValueError("broken on purpose")

    logged, quiet = TaskSet("logged"), TaskSet("quiet", log_failures=False)
    logged.spawn(fail(), name="failing")
    quiet.spawn(fail(), name="silent")
    await logged.wait()
    await quiet.wait()
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["logged: task failing failed"]


async def test_once_runs_its_function_once_for_every_caller():
    runs = 0
    gate = asyncio.Event()

    async def run() -> None:
        nonlocal runs
        runs += 1
        await gate.wait()

    once = Once(run)
    callers = [asyncio.ensure_future(once()) for _ in range(3)]
    await asyncio.sleep(0)
    assert once.begun and once.running
    gate.set()
    await asyncio.gather(*callers)
    await once()
    assert runs == 1 and not once.running


async def test_a_cancelled_caller_does_not_stop_the_run_of_once():
    gate = asyncio.Event()
    done = []

    async def run() -> None:
        await gate.wait()
        done.append(True)

    once = Once(run)
    caller = asyncio.ensure_future(once())
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    gate.set()
    await once.wait()
    assert done == [True]


async def test_resolve_threadsafe_sets_a_result_from_another_thread_once():
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    await asyncio.to_thread(resolve_threadsafe, future, 1)
    assert await future == 1
    resolve_threadsafe(future, 2)  # already done: ignored
    assert future.result() == 1
