"""Where tier coroutines run: the host's loop, a loop thread, or none at all."""

from __future__ import annotations

import asyncio
import threading

import anyio
import anyio.to_thread
import pytest

from kvtier.tiering.loop import HostLoop, LoopThread, run_inline


async def answer() -> int:
    return 42


def test_a_loop_thread_runs_coroutines_for_a_blocking_caller_and_stops_once():
    loop = LoopThread(name="kvtier-test-loop")
    try:
        assert loop.run(answer) == 42

        async def where() -> bool:
            return loop.in_loop_thread()

        assert loop.run(where)
        assert not loop.in_loop_thread()
    finally:
        loop.close()
        loop.close()
    assert not any(t.name == "kvtier-test-loop" for t in threading.enumerate())


def test_a_loop_thread_cannot_be_stopped_from_its_own_thread():
    loop = LoopThread(name="kvtier-test-inside")

    async def stop_from_inside() -> None:
        loop.close()

    with pytest.raises(RuntimeError, match="its own thread"):
        loop.run(stop_from_inside)
    assert loop.running
    loop.close()
    assert not any(t.name == "kvtier-test-inside" for t in threading.enumerate())


@pytest.mark.anyio
async def test_a_blocking_call_on_the_host_loop_s_own_thread_is_refused():
    host = HostLoop()
    assert host.in_loop_thread()
    with pytest.raises(RuntimeError, match="await its async variant"):
        host.run(answer)
    assert await host.run_async(answer) == 42
    assert await asyncio.to_thread(host.run, answer) == 42


def test_a_host_loop_needs_a_running_loop():
    with pytest.raises(RuntimeError, match="LoopThread"):
        HostLoop()


@pytest.mark.anyio
async def test_an_async_caller_on_another_loop_awaits_work_on_a_loop_thread():
    loop = LoopThread()
    try:

        async def thread_name() -> str:
            return threading.current_thread().name

        assert await loop.run_async(thread_name) == "kvtier-tiers"
    finally:
        loop.close()


def test_run_inline_returns_what_a_coroutine_that_never_waits_returns():
    assert run_inline(answer) == 42


def test_run_inline_refuses_a_coroutine_that_would_wait():
    async def waits() -> None:
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="without an event loop was asked to wait"):
        run_inline(waits)


def test_a_loop_thread_keeps_its_worker_threads_from_one_call_to_the_next():
    # anyio ties its worker threads to the root task: each call's task must not be one.
    loop = LoopThread()
    try:

        async def worker_thread() -> threading.Thread:
            return await anyio.to_thread.run_sync(threading.current_thread)

        async def in_a_task_of_its_own() -> threading.Thread:
            return await asyncio.get_running_loop().create_task(worker_thread())

        first = loop.run(in_a_task_of_its_own)
        assert loop.run(in_a_task_of_its_own) is first
        assert first.is_alive()
    finally:
        loop.close()
