"""Resources close once, by either verb; task sets own their tasks; Once runs once."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import pkgutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anyio.to_thread
import pytest
import torch
from helpers import make_config, scripted, tiering_config
from scripted_tier import ScriptedTier

import kvtier
from kvtier import KVTier, OffloadingSpecFactory, SharedOffloadRegion
from kvtier.config import PAGE_SIZE
from kvtier.region import region_path
from kvtier.resources import (
    AsyncResource,
    Once,
    Resource,
    TaskSet,
    close_all,
    resolve_threadsafe,
)
from kvtier.tiering.loop import HostLoop, LoopThread
from kvtier.worker.engines import CpuCopyEngine

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
    [record] = caplog.records
    first, *traceback = record.getMessage().splitlines()
    assert first == "logged: task failing failed: ValueError: broken on purpose"
    assert traceback[0] == "Traceback (most recent call last):"
    assert record.exc_info is None  # the text is all the record keeps


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


# ------------------------------------------------------------ the close protocol

VERBS = ("close", "aclose", "shutdown")

#: Classes of kvtier that close something without being a Resource, and why.
NOT_RESOURCES = {
    # A set of tasks its owner drains or cancels when the owner closes.
    "kvtier.resources.TaskSet",
    # vLLM's interfaces: vLLM calls shutdown(), which closes the kvtier resource inside.
    "kvtier.integrations.vllm.KVTierOffloadingManager",
    "kvtier.integrations.vllm.KVTierOffloadingWorker",
}


def kvtier_classes() -> Iterator[type]:
    for info in pkgutil.walk_packages(kvtier.__path__, "kvtier."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] in ("vllm", "sglang"):  # nox -s vllm / sglang
                continue
            raise
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__ == module.__name__:
                yield value


def closes_something(cls: type) -> bool:
    """Whether kvtier code (not a base from elsewhere, such as logging.Handler) gives
    ``cls`` a close verb."""
    return any(
        verb in vars(base)
        for base in cls.__mro__
        if base.__module__.startswith("kvtier")
        for verb in VERBS
    )


def test_every_class_of_kvtier_that_closes_something_offers_both_verbs():
    closing = [
        cls
        for cls in kvtier_classes()
        if closes_something(cls) and f"{cls.__module__}.{cls.__qualname__}" not in NOT_RESOURCES
    ]
    assert len(closing) > 20, "the walk over kvtier's modules found too little"
    assert [cls.__qualname__ for cls in closing if not issubclass(cls, Resource)] == []
    for cls in closing:
        assert inspect.iscoroutinefunction(cls.aclose), cls
        assert not inspect.iscoroutinefunction(cls.close), cls


KV_BYTES_PER_BLOCK = 4096


@dataclass
class Made:
    """A real resource, whether what it holds was released exactly once, and its owner
    (closed after the test, whatever the test did)."""

    resource: Resource
    released_once: Callable[[], bool]
    owner: Resource | None = None


def make_region(engine_id: str) -> Made:
    region = SharedOffloadRegion(
        engine_id, num_chunks=4, chunk_bytes=PAGE_SIZE, column_bytes=PAGE_SIZE, world_size=1, rank=0
    )
    return Made(region, lambda: region.closed and not region_path(engine_id).exists())


def make_loop_thread(engine_id: str) -> Made:
    name = f"kvtier-{engine_id}"
    loop = LoopThread(name=name)
    return Made(loop, lambda: not any(t.name == name for t in threading.enumerate()))


def make_spec(engine_id: str) -> Made:
    """A tiering spec that built its manager (a loop thread, one tier) and a worker."""
    spec = OffloadingSpecFactory.create_spec(tiering_config(engine_id, [scripted(engine_id)]))
    manager = spec.get_manager()
    worker = spec.create_worker([torch.zeros((8, KV_BYTES_PER_BLOCK), dtype=torch.uint8)])
    tier = ScriptedTier.instances[engine_id]

    def released_once() -> bool:
        return (
            tier.closes == 1
            and manager.closed
            and not manager.loop.running  # type: ignore[union-attr]
            and worker.region.closed
            and not region_path(engine_id).exists()
        )

    return Made(spec, released_once)


def make_manager(engine_id: str) -> Made:
    spec = make_spec(engine_id).resource
    manager = spec.get_manager()  # type: ignore[attr-defined]
    tier = ScriptedTier.instances[engine_id]
    return Made(
        manager,
        lambda: tier.closes == 1 and manager.closed and manager.region.closed,
        owner=spec,
    )


MAKERS = {
    "region": make_region,
    "loop thread": make_loop_thread,
    "spec": make_spec,
    "manager": make_manager,
}


@pytest.fixture(params=list(MAKERS))
def made(request: pytest.FixtureRequest, engine_id: str) -> Iterator[Made]:
    ScriptedTier.instances.clear()
    built = MAKERS[request.param](engine_id)
    yield built
    (built.owner or built.resource).close()


def test_calling_close_twice_releases_once(made: Made):
    made.resource.close()
    made.resource.close()
    assert made.released_once()


def test_calling_aclose_twice_releases_once(made: Made):
    async def twice() -> None:
        await made.resource.aclose()
        await made.resource.aclose()

    asyncio.run(twice())
    assert made.released_once()


def test_close_after_aclose_does_nothing_more(made: Made):
    asyncio.run(made.resource.aclose())
    made.resource.close()
    assert made.released_once()


def test_aclose_after_close_does_nothing_more(made: Made):
    made.resource.close()
    asyncio.run(made.resource.aclose())
    assert made.released_once()


def test_spec_shutdown_is_close(engine_id):
    built = make_spec(engine_id)
    spec = built.resource
    spec.shutdown()  # type: ignore[attr-defined]
    assert built.released_once()
    spec.close()
    asyncio.run(spec.aclose())
    assert built.released_once()


def test_manager_shutdown_is_close(engine_id):
    built = make_manager(engine_id)
    built.resource.shutdown()  # type: ignore[attr-defined]
    assert built.released_once()
    built.resource.close()
    assert built.released_once()
    assert built.owner is not None
    built.owner.close()


async def test_a_blocking_close_on_the_host_loop_that_runs_the_tiers_is_refused(engine_id):
    spec = OffloadingSpecFactory.create_spec(tiering_config(engine_id, [scripted(engine_id)]))
    manager = spec.get_manager(loop=HostLoop())
    await manager.start()
    for close in (manager.close, manager.shutdown, spec.close, spec.shutdown):
        with pytest.raises(RuntimeError, match=r"would block the event loop .* await aclose\(\)"):
            close()
    assert not manager.closed
    await spec.aclose()
    assert manager.closed and not region_path(engine_id).exists()


def test_a_blocking_close_on_the_loop_thread_that_runs_the_tiers_is_refused(engine_id):
    spec = OffloadingSpecFactory.create_spec(tiering_config(engine_id, [scripted(engine_id)]))
    manager = spec.get_manager()
    assert manager.loop is not None

    async def close_from_the_tier_loop() -> None:
        manager.close()

    with pytest.raises(RuntimeError, match=r"TieringOffloadingManager\.close\(\) would block"):
        manager.loop.run(close_from_the_tier_loop)
    assert not manager.closed
    spec.close()
    assert manager.closed and not region_path(engine_id).exists()


class EngineThatFailsToClose(CpuCopyEngine):
    """A CPU copy engine whose device is gone by the time it closes."""

    def close(self) -> None:
        super().close()
        raise OSError("the copy device went away")


@pytest.mark.parametrize("verb", ["close", "aclose"])
def test_a_part_that_fails_to_close_is_logged_and_the_rest_still_close(engine_id, caplog, verb):
    spec = OffloadingSpecFactory.create_spec(make_config(engine_id))
    worker = spec.create_worker(
        [torch.zeros((8, KV_BYTES_PER_BLOCK), dtype=torch.uint8)], engine=EngineThatFailsToClose()
    )
    manager = spec.get_manager()
    with caplog.at_level(logging.ERROR, logger="kvtier"):
        if verb == "close":
            spec.close()
        else:
            asyncio.run(spec.aclose())
    assert worker.region.closed and manager.closed and not region_path(engine_id).exists()
    failures = [r for r in caplog.records if "failed to close" in r.getMessage()]
    assert len(failures) == 1 and "EngineThatFailsToClose" in failures[0].getMessage()


def test_close_all_closes_every_part_after_one_that_fails(engine_id, caplog):
    first, last = make_region(f"{engine_id}-a"), make_region(f"{engine_id}-b")
    with caplog.at_level(logging.ERROR, logger="kvtier"):
        close_all("closing test", [first.resource, EngineThatFailsToClose(), last.resource])
    assert first.released_once() and last.released_once()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["closing test"]


class LoopRecordingKVTier(KVTier):
    """A facade that notes the loop its close runs on."""

    closed_on: asyncio.AbstractEventLoop | None = None

    async def aclose(self) -> None:
        self.closed_on = asyncio.get_running_loop()
        await super().aclose()


async def test_a_facade_closed_from_another_thread_closes_on_the_loop_it_was_opened_on(
    engine_id,
):
    kv = await LoopRecordingKVTier.open(
        make_config(engine_id), [torch.zeros((8, KV_BYTES_PER_BLOCK), dtype=torch.uint8)]
    )
    await anyio.to_thread.run_sync(kv.close)
    assert kv.closed_on is asyncio.get_running_loop()
    assert kv.closed and not region_path(engine_id).exists()
