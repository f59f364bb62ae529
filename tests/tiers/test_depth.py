"""The adaptive I/O depth: its controller on synthetic devices, its meter, its limiter."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import anyio
import pytest

from kvtier.tiers._depth import (
    HOLD_WINDOWS,
    MIN_WINDOW_S,
    DepthController,
    DepthRange,
    IoDepth,
    IoMeter,
    IoWindow,
    window_ios,
)
from kvtier.tiers._fileio import in_threads

CHUNK = 2 << 20
GB = 1e9


def device(curve: Callable[[int], float]) -> Callable[[int], IoWindow]:
    """A device whose throughput at each depth is ``curve(depth)`` bytes per second,
    kept busy at that depth: 0.1 s windows of 2 MiB operations, each taking what
    Little's law says (depth over throughput)."""

    def window(depth: int) -> IoWindow:
        throughput = curve(depth)
        seconds = 0.1
        ios = round(throughput * seconds / CHUNK)
        latency = depth * CHUNK / throughput
        return IoWindow(depth, ios * CHUNK, seconds, ios, ios * latency)

    return window


def saturating_at(knee: int, per_op: float = 0.2 * GB) -> Callable[[int], IoWindow]:
    return device(lambda depth: min(depth, knee) * per_op)


def run(controller: DepthController, windows: Callable[[int], IoWindow], count: int) -> list[int]:
    """The depth each of ``count`` windows ran at."""
    depths = []
    for _ in range(count):
        depths.append(controller.depth)
        controller.observe(windows(controller.depth))
    return depths


def settled(depths: list[int]) -> int:
    return Counter(depths).most_common(1)[0][0]


# ------------------------------------------------------------ the controller


def test_a_device_that_saturates_at_eight_settles_at_eight():
    controller = DepthController(DepthRange.adaptive())
    depths = run(controller, saturating_at(8), 80)
    # Up a quarter step; it paid in proportion, so the next doubles; past the knee,
    # back down under the depth the doubling reached until a step down costs.
    assert depths[:6] == [4, 5, 10, 12, 8, 6]
    tail = depths[-48:]
    assert settled(tail) == 8
    # Now and then it looks one step either way, and comes back.
    assert set(tail) <= {6, 8, 10}
    assert tail.count(8) >= len(tail) * 0.8


def test_a_device_that_saturates_at_two_settles_at_two():
    controller = DepthController(DepthRange.adaptive(minimum=1))
    depths = run(controller, saturating_at(2), 80)
    # Up gains nothing, so down from 4 until a step costs (1), then back.
    assert depths[:6] == [4, 5, 3, 2, 1, 2]
    tail = depths[-48:]
    assert settled(tail) == 2
    assert set(tail) <= {1, 2, 3}


def test_a_disk_that_gains_half_again_from_four_to_sixteen_is_driven_to_the_top():
    # The measured VM disk: depth 16 stored ~1.5x what depth 4 did.
    controller = DepthController(DepthRange.adaptive())
    depths = run(controller, device(lambda d: 2 * GB * d / (d + 3.2)), 60)
    assert settled(depths[-40:]) >= 12


def test_a_latency_blow_up_halves_the_depth():
    controller = DepthController(DepthRange.adaptive())
    steady = saturating_at(8)
    run(controller, steady, 40)
    while controller.depth != 8:  # a look either way: wait until it is back
        controller.observe(steady(controller.depth))
    quarter_speed = device(lambda depth: min(depth, 8) * 0.05 * GB)
    controller.observe(quarter_speed(8))
    assert controller.depth == 8  # one slow window may be someone else's burst
    controller.observe(quarter_speed(8))
    assert controller.depth == 4
    # Still slow: it measures again from there and climbs only as far as it pays.
    depths = run(controller, quarter_speed, 40)
    assert settled(depths[-20:]) == 8


# A store as the fs tier runs one: windows as IoDepth closes them (window_ios operations
# and MIN_WINDOW_S busy), on a device whose throughput at each depth may change over
# time; the figure is the run's GB/s, as a store's clock sees it.


def store_run(
    depth: int | DepthController, throughput: Callable[[float, int], float], ios: int = 2048
) -> tuple[float, list[int]]:
    """GB/s of ``ios`` 2 MiB writes at a fixed depth or as the controller steers it,
    ``throughput(seconds so far, depth)`` bytes a second; and the depth of each window."""
    seconds, done, depths = 0.0, 0, []
    while done < ios:
        now = depth if isinstance(depth, int) else depth.depth
        rate = throughput(seconds, now)
        length = max(MIN_WINDOW_S, window_ios(now) * CHUNK / rate)
        count = max(1, round(rate * length / CHUNK))
        seconds, done = seconds + length, done + count
        depths.append(now)
        if isinstance(depth, DepthController):
            latency = now * CHUNK / rate
            depth.observe(IoWindow(now, count * CHUNK, length, count, count * latency))
    return done * CHUNK / seconds / GB, depths


def costly_creation(extra_s: float, from_s: float) -> Callable[[float, int], float]:
    """The measured VM disk (2 GB/s, depth 16 about 1.5x depth 4), with ``extra_s``
    more per file from ``from_s`` on: files removed nearby on an ext4 without a journal,
    or a busy CPU. That time is each file's own, so more files at once hide it."""

    def throughput(seconds: float, depth: int) -> float:
        extra = extra_s if seconds >= from_s else 0.0
        return depth * CHUNK / (extra + (depth + 3.2) * CHUNK / (2 * GB))

    return throughput


@pytest.mark.parametrize(
    ("extra_ms", "from_s"),
    [(5, 0.0), (10, 0.0), (20, 0.0), (40, 0.0), (5, 1.0), (10, 1.0), (20, 1.0)],
    ids=lambda value: f"{value}",
)
def test_files_that_cost_more_to_create_keep_stores_within_a_tenth_of_the_best_fixed_depth(
    extra_ms, from_s
):
    device = costly_creation(extra_ms / 1e3, from_s)
    best = max(store_run(depth, device)[0] for depth in (2, 4, 8, 16, 24, 32))
    adaptive, depths = store_run(DepthController(DepthRange.adaptive(2, 32, 16)), device)
    assert adaptive >= 0.9 * best, depths


def test_a_store_that_slows_at_the_same_depth_probes_a_doubling_first():
    controller = DepthController(DepthRange.adaptive(2, 32, 16))
    steady = costly_creation(0.0, 0.0)
    while controller.depth != 16 or controller._phase.value != "hold":
        store_run(controller, steady, ios=window_ios(controller.depth))
    # 10 ms more per file: a fifth slower at 16, short of a blow-up.
    depths = store_run(controller, costly_creation(0.01, 0.0), ios=window_ios(16) * 4)[1]
    assert depths[:2] == [16, 32]


def test_a_halving_that_loses_what_the_depth_gave_is_undone_with_a_bold_climb():
    # At 16 on a steady device, files suddenly cost 40 ms more each: the windows'
    # latency blows up, the depth halves, and the halved depth delivers half as much.
    controller = DepthController(DepthRange.adaptive(2, 32, 16))
    steady = costly_creation(0.0, 0.0)
    while controller.depth != 16 or controller._phase.value != "hold":
        store_run(controller, steady, ios=window_ios(controller.depth))
    costly = costly_creation(0.04, 0.0)
    depths = store_run(controller, costly, ios=window_ios(16) * 6)[1]
    assert depths[:3] == [16, 16, 8]
    # Back above where it halved from at once, doubling: the device did not slow.
    assert depths[3] == 32


def test_one_slow_window_between_normal_ones_changes_nothing():
    controller = DepthController(DepthRange.adaptive())
    steady = saturating_at(8)
    run(controller, steady, 40)
    while controller.depth != 8:
        controller.observe(steady(controller.depth))
    slow = device(lambda depth: min(depth, 8) * 0.05 * GB)
    for _ in range(5):
        controller.observe(slow(8))
        controller.observe(steady(8))
    assert controller.depth == 8


def test_an_unused_depth_is_never_raised_or_lowered():
    # Two operations in flight whatever the depth: the work offered, not the depth,
    # sets the pace, and the windows say nothing about the depth.
    controller = DepthController(DepthRange.adaptive())

    def light(depth: int) -> IoWindow:
        return IoWindow(depth, 64 * CHUNK, 0.1, 64, 2 * 0.1)

    assert set(run(controller, light, 40)) == {4}


def test_a_probe_the_work_does_not_fill_goes_back():
    controller = DepthController(DepthRange.adaptive())
    busy = saturating_at(16)
    controller.observe(busy(4))
    assert controller.depth == 5
    # The fifth operation never came: no evidence that it helps.
    unfilled = busy(4)
    controller.observe(IoWindow(5, unfilled.bytes, 0.1, unfilled.ios, 3 * 0.1))
    assert controller.depth == 4


def test_a_device_that_gets_faster_is_followed_up():
    controller = DepthController(DepthRange.adaptive())
    run(controller, saturating_at(4), 40)
    assert controller.depth == 4
    depths = run(controller, saturating_at(16), 4 * HOLD_WINDOWS)
    assert settled(depths[-HOLD_WINDOWS:]) == 16


def test_a_fixed_range_never_moves():
    controller = DepthController(DepthRange.fixed(6))
    assert set(run(controller, saturating_at(16), 30)) == {6}


def test_a_window_of_another_depth_is_ignored():
    controller = DepthController(DepthRange.adaptive())
    controller.observe(saturating_at(16)(4))
    assert controller.depth == 5
    controller.observe(saturating_at(16)(4))  # cut across the change: stale
    assert controller.depth == 5


def test_the_depth_stays_within_its_bounds():
    controller = DepthController(DepthRange.adaptive(minimum=3, maximum=6))
    assert max(run(controller, saturating_at(64), 40)) == 6
    controller = DepthController(DepthRange.adaptive(minimum=3, maximum=6))
    assert min(run(controller, saturating_at(1), 40)) == 3


def test_the_start_is_clipped_into_the_range():
    assert DepthRange.adaptive(minimum=6, maximum=8).start == 6
    assert DepthRange.adaptive(minimum=1, maximum=2).start == 2
    with pytest.raises(ValueError, match="minimum <= start <= maximum"):
        DepthRange(1, 2, 8)


# ----------------------------------------------------------------- the meter


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_busy_time_is_the_union_of_runs_and_idle_time_is_left_out():
    clock = Clock()
    meter = IoMeter(clock)
    meter.run_started()  # t = 0
    clock.now = 5.0
    meter.run_started()
    clock.now = 10.0
    meter.io_done(100, 10.0)
    meter.run_ended()
    clock.now = 15.0
    meter.io_done(100, 10.0)
    meter.run_ended()
    clock.now = 20.0  # idle from 15 to 20
    meter.run_started()
    clock.now = 25.0
    meter.io_done(50, 5.0)
    meter.run_ended()
    window = meter.take(2)
    assert window == IoWindow(depth=2, bytes=250, seconds=20.0, ios=3, io_seconds=25.0)
    assert (window.throughput, window.latency, window.in_flight) == (12.5, 25.0 / 3, 1.25)


def test_a_window_taken_mid_run_leaves_the_rest_of_the_run_to_the_next():
    clock = Clock()
    meter = IoMeter(clock)
    meter.run_started()
    clock.now = 4.0
    meter.io_done(10, 4.0)
    assert meter.take(1).seconds == 4.0
    assert meter.ios == 0
    clock.now = 7.0
    meter.run_ended()
    assert meter.take(1) == IoWindow(1, 0, 3.0, 0, 0.0)


@pytest.mark.anyio
async def test_a_full_window_moves_the_limiter_and_the_gauge():
    clock = Clock()
    published: list[int] = []
    lane = IoDepth(DepthRange.adaptive(), published.append, clock)
    lane.start()
    assert (lane.limiter.total_tokens, published) == (4, [4])
    for _ in range(4):  # four threads busy all along: the depth is the limit
        lane.meter.run_started()
    ios = window_ios(4)
    for _ in range(ios):
        lane.meter.io_done(CHUNK, 4 * MIN_WINDOW_S / ios)
    clock.now = MIN_WINDOW_S / 2
    lane.poll()  # enough operations, but not busy long enough
    assert (lane.limiter.total_tokens, published) == (4, [4])
    clock.now = MIN_WINDOW_S
    lane.poll()
    assert (lane.limiter.total_tokens, lane.threads.depth, lane.depth) == (5, 5, 5)
    assert published == [4, 5]
    assert lane.meter.ios == 0
    for _ in range(window_ios(5) - 1):
        lane.meter.io_done(CHUNK, 0.01)
    clock.now = 10.0
    lane.poll()  # long enough, one operation short
    assert (lane.limiter.total_tokens, published) == (5, [4, 5])


@pytest.mark.anyio
async def test_a_fixed_lane_keeps_its_depth_and_publishes_it_once():
    published: list[int] = []
    lane = IoDepth(DepthRange.fixed(3), published.append)
    lane.start()
    for _ in range(1000):
        lane.meter.io_done(CHUNK, 0.001)
    lane.poll()
    assert (lane.limiter.total_tokens, lane.threads.depth, published) == (3, 3, [3])


# ---------------------------------------------------------------- the threads


@pytest.mark.anyio
async def test_every_item_is_done_once_in_order_by_at_most_depth_threads():
    lane = IoDepth(DepthRange.fixed(3))
    lane.start()
    lock = threading.Lock()
    running = [0, 0]  # now, most

    def work(item: int) -> int:
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        threading.Event().wait(0.001)
        with lock:
            running[0] -= 1
        return item * 2

    assert await in_threads(work, list(range(50)), lane, 10) == [i * 2 for i in range(50)]
    assert 1 <= running[1] <= 3
    assert lane.meter.ios == 50


@pytest.mark.anyio
async def test_the_first_failure_is_raised_after_every_thread_ended():
    lane = IoDepth(DepthRange.fixed(2))
    lane.start()
    done: list[int] = []

    def work(item: int) -> int:
        if item == 3:
            raise OSError(5, "bad sector")
        done.append(item)
        return item

    with pytest.raises(OSError, match="bad sector"):
        await in_threads(work, list(range(10)), lane, 1)
    assert sorted(done) == [0, 1, 2, 4, 5, 6, 7, 8, 9]


@pytest.mark.anyio
async def test_a_batch_takes_up_a_depth_raised_while_it_runs():
    lane = IoDepth(DepthRange.adaptive(minimum=2, maximum=8, start=2))
    lane.start()
    release, third = threading.Event(), threading.Event()

    def work(item: int) -> int:
        if item < 2:  # the first two hold both threads the depth allows
            assert release.wait(30)
        else:
            third.set()
        return item

    async def raise_depth_then_release() -> None:
        await anyio.sleep(0.05)
        assert not third.is_set()  # a third thread waits for the depth
        lane.apply(3)
        # It joins while the first two still hold theirs.
        assert await anyio.to_thread.run_sync(third.wait, 30)
        release.set()

    async with anyio.create_task_group() as group:
        group.start_soon(raise_depth_then_release)
        assert await in_threads(work, list(range(6)), lane, 1) == list(range(6))


@pytest.mark.anyio
async def test_a_cancelled_batch_drops_what_no_thread_began_and_outlives_what_one_did():
    lane = IoDepth(DepthRange.fixed(1))
    lane.start()
    began, release = threading.Event(), threading.Event()
    ran: list[int] = []
    order: list[str] = []

    def work(item: int) -> int:
        ran.append(item)
        if item == 0:
            began.set()
            assert release.wait(30)
            order.append("item 0 ended")
        return item

    scopes: list[anyio.CancelScope] = []

    async def call() -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await in_threads(work, list(range(10)), lane, 1)
        order.append("call returned")

    async with anyio.create_task_group() as group:
        group.start_soon(call)
        assert await anyio.to_thread.run_sync(began.wait, 30)
        scopes[0].cancel()
        await anyio.sleep(0.1)
        assert order == []  # cancelled, the call still waits for the item begun
        release.set()
    (scope,) = scopes
    assert scope.cancelled_caught
    assert ran == [0]  # the nine others were never begun
    assert order == ["item 0 ended", "call returned"]


@pytest.mark.anyio
async def test_the_lane_runs_on_threads_of_its_own_that_end_when_it_closes():
    lane = IoDepth(DepthRange.fixed(3), name="kvtier-test-read")
    lane.start()
    names: set[str] = set()

    def work(item: int) -> int:
        names.add(threading.current_thread().name)
        threading.Event().wait(0.002)
        return item

    for _ in range(3):
        assert await in_threads(work, list(range(12)), lane, 1) == list(range(12))
    assert names <= {f"kvtier-test-read-{i}" for i in range(3)}, names
    assert lane.threads.started == 3  # started once, for every batch
    lane.close()
    for thread in threading.enumerate():
        if thread.name.startswith("kvtier-test-read-"):
            thread.join(10)
            assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="kvtier-test-read: the I/O threads are closed"):
        await in_threads(work, [1], lane, 1)
