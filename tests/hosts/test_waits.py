"""step_until: a host steps until what it waits for holds, waiting for completions
after the mark read before each step, never polling and never missing a wake-up.

Several tests here wait with no deadline at all: a wake-up lost would leave them
waiting for good, and the test's timeout would fail them.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from helpers import keys, make_config, tiering_config
from scripted_tier import ScriptedTier

from kvtier import LookupResult, OffloadingSpecFactory, ReqContext
from kvtier.hosts import Fence, Step, step_until, step_until_blocking

pytestmark = pytest.mark.timeout(60)

HIT = LookupResult.HIT


def sync_manager(config):
    spec = OffloadingSpecFactory.create_spec(config)
    return spec, spec.get_manager()


def store(manager, ks, req):
    out = manager.prepare_store(ks, req)
    assert out is not None
    manager.complete_store(out.keys_to_store, req)


def test_a_completion_between_the_step_and_the_wait_ends_the_wait(engine_id):
    spec, manager = sync_manager(make_config(engine_id))
    try:
        [key] = keys("between", 1)
        req = ReqContext("reader")
        store(manager, [key], ReqContext("writer"))
        manager.prepare_load([key], req)
        released = False

        def step() -> Step:
            nonlocal released
            if released:
                return Step.DONE
            # The pin goes after this step looked and before its wait begins: only the
            # mark read before the step can tell the wait that it already happened.
            manager.complete_load([key], req)
            released = True
            return Step.WAIT

        assert step_until_blocking(manager.host, step)
    finally:
        spec.shutdown()


def test_a_thread_waiting_for_promotions_wakes_for_every_one(engine_id):
    spec, manager = sync_manager(tiering_config(engine_id, [{"type": "example"}], chunks=4))
    try:
        for round_ in range(50):
            [key] = keys(f"promoted-{round_}", 1)
            store(manager, [key], ReqContext(f"w{round_}"))
            assert step_until_blocking(manager.host, lambda: _idle(manager))
            manager.reset_cache()
            req = ReqContext(f"r{round_}")

            def promoted(key=key, req=req) -> Step:
                if manager.lookup(key, req) is HIT:
                    return Step.DONE
                manager.on_schedule_end()
                return Step.WAIT

            # No deadline: the promotion's completion, on the tier loop's thread, is
            # the only thing that can end each wait.
            assert step_until_blocking(manager.host, promoted)
            manager.on_request_finished(req)
    finally:
        spec.shutdown()


def _idle(manager) -> Step:
    manager.on_schedule_end()
    return Step.WAIT if manager.has_pending_work() else Step.DONE


def test_the_wait_ends_at_the_requests_deadline_in_the_manager(engine_id):
    tag = f"held-{engine_id}"
    tiers = [{"type": "ScriptedTier", "module_path": "scripted_tier", "tag": tag, "instant": True}]
    spec, manager = sync_manager(tiering_config(engine_id, tiers, chunks=4, max_pending_s=0.2))
    tier = ScriptedTier.instances[tag]
    try:
        [key] = keys("held", 1)
        store(manager, [key], ReqContext("w"))
        assert step_until_blocking(manager.host, lambda: _idle(manager))
        manager.reset_cache()
        manager.loop.call(tier.gate.clear)  # the promotion never finishes
        req = ReqContext("waiting")

        def pending() -> Step:
            if manager.lookup(key, req) is LookupResult.HIT_PENDING:
                manager.on_schedule_end()
                return Step.WAIT
            return Step.DONE

        # No deadline of the host's own and no completion to come: only the
        # manager's deadline for the request ends the wait.
        assert not step_until_blocking(manager.host, pending, req=req)
        assert manager.lookup(key, req) is LookupResult.MISS
    finally:
        manager.loop.call(tier.gate.set)
        spec.shutdown()


def test_a_deadline_that_passes_ends_the_wait(engine_id):
    spec, manager = sync_manager(make_config(engine_id))
    try:
        steps = []

        def never() -> Step:
            steps.append(1)
            return Step.WAIT

        assert not step_until_blocking(manager.host, never, deadline=time.monotonic() + 0.05)
        assert steps  # it stepped at least once before giving up
    finally:
        spec.shutdown()


def test_recheck_steps_again_without_a_completion(engine_id):
    spec, manager = sync_manager(make_config(engine_id))
    try:
        changed = threading.Event()
        timer = threading.Timer(0.05, changed.set)  # a change kvtier is not told of
        timer.start()
        step = lambda: Step.DONE if changed.is_set() else Step.WAIT  # noqa: E731
        assert step_until_blocking(manager.host, step, recheck=lambda: 0.01)
        timer.join()
    finally:
        spec.shutdown()


def test_a_step_that_moved_something_is_followed_at_once(engine_id):
    spec, manager = sync_manager(make_config(engine_id))
    try:
        left = [3]

        def moving() -> Step:
            left[0] -= 1
            return Step.AGAIN if left[0] else Step.DONE

        # The deadline has passed, yet steps that move go on: only waits end by it.
        assert step_until_blocking(manager.host, moving, deadline=time.monotonic() - 1)
        assert left == [0]
    finally:
        spec.shutdown()


@pytest.mark.anyio
async def test_a_task_waiting_for_a_completion_wakes_for_it(engine_id):
    spec = OffloadingSpecFactory.create_spec(make_config(engine_id))
    manager = spec.get_manager()
    await manager.start()
    try:
        [key] = keys("async", 1)
        req = ReqContext("reader")
        store(manager, [key], ReqContext("writer"))
        manager.prepare_load([key], req)
        released = asyncio.Event()

        async def release() -> None:
            await asyncio.sleep(0.01)
            manager.complete_load([key], req)
            released.set()

        task = asyncio.create_task(release())
        step = lambda: Step.DONE if released.is_set() else Step.WAIT  # noqa: E731
        assert await step_until(manager.host, step)
        await task
    finally:
        await spec.aclose()


@pytest.mark.anyio
async def test_a_fence_going_up_stops_a_task_waiting_without_a_deadline(engine_id):
    spec = OffloadingSpecFactory.create_spec(make_config(engine_id))
    manager = spec.get_manager()
    await manager.start()
    try:
        fence = Fence()
        waiting = asyncio.Event()

        def never() -> Step:
            waiting.set()
            return Step.WAIT

        async def operation() -> bool:
            async with fence.operation():
                return await step_until(manager.host, never, fence=fence)

        task = asyncio.create_task(operation())
        await waiting.wait()
        async with fence.fenced():
            assert task.done()
        assert not await task
    finally:
        await spec.aclose()
