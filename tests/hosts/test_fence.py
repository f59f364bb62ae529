"""Fence: a host's operations side by side, a reset or close alone, from tasks and
threads alike."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvtier.hosts import Fence

#: How long a test lets a thread get somewhere before it calls it stuck (never a
#: measured duration: a healthy run takes microseconds).
PATIENCE_S = 30.0


def settle_until(predicate) -> None:
    """Wait (sleeping on an event that never fires) until ``predicate`` holds."""
    never = threading.Event()
    for _ in range(int(PATIENCE_S / 0.005)):
        if predicate():
            return
        never.wait(0.005)
    raise AssertionError("the other thread made no progress")


def test_operations_run_side_by_side():
    fence = Fence()
    with fence.operation_blocking() as first, fence.operation_blocking() as second:
        assert first and second
        assert fence.active == 2
    assert fence.active == 0


def test_a_fence_waits_for_the_operations_in_flight_and_holds_back_new_ones():
    fence = Fence()
    leave, order = threading.Event(), []

    def operation(name: str, hold: threading.Event | None) -> None:
        with fence.operation_blocking():
            order.append(name)
            if hold is not None:
                assert hold.wait(PATIENCE_S)

    def reset() -> None:
        with fence.fenced_blocking():
            order.append("reset")

    first = threading.Thread(target=operation, args=("first", leave))
    first.start()
    settle_until(lambda: fence.active == 1)
    resetter = threading.Thread(target=reset)
    resetter.start()
    settle_until(lambda: fence.raised)
    later = threading.Thread(target=operation, args=("later", None))
    later.start()
    later.join(0.1)
    assert later.is_alive(), "an operation entered while a fence stood"
    assert order == ["first"]
    leave.set()
    for thread in (first, resetter, later):
        thread.join(PATIENCE_S)
    assert order == ["first", "reset", "later"]


def test_a_check_that_raises_keeps_the_operation_out():
    fence = Fence()

    def refuse() -> None:
        raise RuntimeError("closed")

    with pytest.raises(RuntimeError, match="closed"), fence.operation_blocking(refuse):
        pass
    assert fence.active == 0


def test_a_closing_fence_turns_later_operations_away():
    fence = Fence()
    with fence.fenced_blocking(closing=True) as was_open:
        assert was_open
    assert fence.closed
    with fence.operation_blocking() as open_:
        assert not open_
        assert fence.active == 0
    with fence.fenced_blocking(closing=True) as was_open:
        assert not was_open


@pytest.mark.anyio
async def test_raising_a_fence_interrupts_a_tasks_wait_for_tier_work():
    fence = Fence()
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting = asyncio.Event()

    async def operation() -> None:
        async with fence.operation():
            waiting.set()
            await fence.wait_unless_raised(asyncio.shield(never), None)

    task = asyncio.create_task(operation())
    await waiting.wait()
    async with fence.fenced() as was_open:
        assert was_open
        assert task.done()  # it gave up its wait, so the fence could go up
    never.cancel()


@pytest.mark.anyio
async def test_a_task_fences_out_an_operation_of_a_thread_without_blocking_its_loop():
    fence = Fence()
    entered, leave = threading.Event(), threading.Event()

    def operation() -> None:
        with fence.operation_blocking():
            entered.set()
            assert leave.wait(PATIENCE_S)

    thread = threading.Thread(target=operation)
    thread.start()
    assert await asyncio.to_thread(entered.wait, PATIENCE_S)

    async def fenced() -> bool:
        async with fence.fenced():
            return fence.active == 0

    reset = asyncio.create_task(fenced())
    await asyncio.sleep(0)
    assert not reset.done()
    leave.set()  # the loop runs meanwhile: this task got here while the fence waited
    assert await reset
    await asyncio.to_thread(thread.join, PATIENCE_S)
