"""I/O depth that follows the device: how many operations a tier keeps in flight.

A disk (or a link) delivers more with more operations queued, up to a point that moves
with the device and with what else runs on it: measured on the project's VM, 2 MiB
stores ran at 1.0-1.15 GB/s at depth 4 and 1.46-1.73 GB/s at depth 16 one day, and
depth 4 was the best on other days and disks. So the depth is measured, not guessed.

Three parts, each usable on its own:

- :class:`IoMeter` counts completed operations from the I/O threads (bytes, the
  operation's own seconds, the time anything was in flight) and cuts them into
  :class:`IoWindow` observations; a counter update per operation, nothing allocated.
- :class:`DepthController` decides the next depth from one window at a time. It is
  pure and deterministic (no clock, no I/O), so synthetic throughput curves test it.
- :class:`IoDepth` ties both to the direction's threads (:mod:`kvtier.tiers._threads`),
  whose number at work follows the controller, and to a gauge.

The controller climbs a hill: from the accepted depth it tries one step up; the step is
kept while throughput grows enough for the added depth and per-operation latency grows
no more than that queueing explains; otherwise it goes back and tries one step down,
kept while the lower depth loses little. A step that paid nearly in proportion is
followed by a doubling (the knee is far), and a doubling that went past the knee is
followed by steps down from it. Then it holds, watching: windows whose latency blows
up (the device slowed: another tenant, a throttled volume) halve the depth, and every
:data:`HOLD_WINDOWS` windows, or when throughput drifts, it probes again (a drift down
with each operation slower probes a doubling first). A halving
is itself measured: if the halved depth lost what the depth it left delivered, the
device did not slow, each operation costs more (files removed nearby on an ext4
without a journal, a busy CPU), and more operations at once are what hides that, so
it climbs back at once, doubling. Windows in which the depth was not the limit (the
tier had less work in flight than the depth allowed) say nothing about the depth and
are set aside.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from kvtier.metrics import MetricsRecorder, Names
from kvtier.resources import BlockingResource
from kvtier.tiers._threads import IoThreads

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MIN_DEPTH",
    "DEFAULT_START_DEPTH",
    "DepthController",
    "DepthRange",
    "IoDepth",
    "IoMeter",
    "IoWindow",
    "depth_gauge",
    "window_ios",
]

# Where an adaptive depth starts unless its owner says otherwise (the fs tier starts
# higher: see kvtier.tiers.fs).
DEFAULT_START_DEPTH = 4
# The least an adaptive depth goes down to. With one operation in flight the device
# idles while the thread opens, closes and renames files between transfers; a second
# one queued hides that and costs a device that a single stream saturates nothing but
# one operation's worth of latency.
DEFAULT_MIN_DEPTH = 2
# The most an adaptive depth goes up to: vLLM's own tiering runs 16 read and 16 write
# threads, and kvtier at depth 16 matched it on the disk where depth 4 left it idle.
DEFAULT_MAX_DEPTH = 16

# Windows span at least this many completed operations, and WINDOW_TURNS times the
# depth: each holds several full turns of the queue, so the operations cut in half at
# its two ends (and those begun under the previous depth) weigh an eighth at most, and
# one slow file does not decide a step.
MIN_WINDOW_IOS = 32
WINDOW_TURNS = 8
# And at least this long busy: on the project's shared VM, windows of 32 chunks (20-30 ms)
# at one depth swung from 0.64 to 1.97 GB/s with writeback and other tenants; a tenth
# of a second smooths most of that, and a climb from 4 to 16 still takes about a second
# of traffic.
MIN_WINDOW_S = 0.1
# A step up must raise throughput by at least this share of the depth it adds (+25%
# depth: +3.75% throughput). Lower than proportional because throughput is what moves a
# job along and the measured disk gained +45-50% for 4x the depth (from 4 to 16): about
# 0.29 of proportional per step on average. High enough to stay clear of the few percent
# that one window of a busy disk varies by. The same share decides a step down, so that
# the two directions agree about every pair of depths.
GAIN_SHARE = 0.15
# Latency blow-up: windows whose mean operation time exceeds this many times the
# accepted window's (scaled by depth, the share queueing explains) mean that the device
# itself slowed. The depth is halved (the multiplicative decrease of AIMD) and measured
# again. Twice: a halving of throughput at the same depth, beyond the drift of a window.
BLOWUP = 2.0
# ...in this many windows in a row: one slow window is as often a burst of someone
# else's I/O or a writeback as a slower device; it is set aside and the depth measured
# again.
BLOWUP_WINDOWS = 2
# Windows below this share of the depth in flight (mean operations in flight over the
# time anything was) were limited by the work offered, not by the depth: they set
# nothing. Jobs' last operations draining one by one cost a busy tier some of its depth,
# hence not 1.
SATURATED = 0.75
# Held depths are probed again every HOLD_WINDOWS windows, or at once when throughput
# moves by more than DRIFT from the accepted window's: the best depth moves with the
# device and the load (the measured disk's raw reads swung from 1.3 to 3.9 GB/s between
# runs). A probe costs at most two windows at a worse depth (one up, one down) in
# eighteen. At 0.25, files costing 5 ms more each to create (a loss of 20% at depth 16
# that depth 32 wins back) went unprobed for HOLD_WINDOWS windows, most of a store.
HOLD_WINDOWS = 16
DRIFT = 0.15
# A step up whose throughput grew by at least this share of the depth it added (+25%
# depth: +15% throughput) says the device is far from its knee: the next step doubles
# the depth instead of adding a quarter. Without it, a depth that went down while
# files were cheap to create took a dozen windows (seconds) to climb back once each
# file cost milliseconds more to create (files removed nearby on an ext4 without a
# journal, a busy CPU), and a store of gigabytes ran at half speed all that while.
BOLD_GAIN = 0.6


@dataclass(frozen=True, slots=True)
class DepthRange:
    """The depths one direction of a tier may use: fixed when ``minimum == maximum``."""

    start: int
    minimum: int
    maximum: int

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.start <= self.maximum:
            raise ValueError(f"expected 1 <= minimum <= start <= maximum, got {self}")

    @classmethod
    def fixed(cls, depth: int) -> DepthRange:
        return cls(depth, depth, depth)

    @classmethod
    def adaptive(
        cls,
        minimum: int = DEFAULT_MIN_DEPTH,
        maximum: int = DEFAULT_MAX_DEPTH,
        start: int = DEFAULT_START_DEPTH,
    ) -> DepthRange:
        """A range from ``minimum`` to ``maximum``, starting at ``start`` clipped into it."""
        return cls(min(max(start, minimum), maximum), minimum, maximum)

    @property
    def is_fixed(self) -> bool:
        return self.minimum == self.maximum


@dataclass(frozen=True, slots=True)
class IoWindow:
    """Operations completed at one depth, as :class:`DepthController` takes them."""

    #: The depth the operations ran at.
    depth: int
    #: Bytes they moved.
    bytes: int
    #: Seconds during which at least one operation was in flight.
    seconds: float
    #: Operations completed.
    ios: int
    #: Their own durations added up (each from its start on a thread to its end).
    io_seconds: float

    @property
    def throughput(self) -> float:
        """Bytes per second while the tier was busy."""
        return self.bytes / self.seconds

    @property
    def latency(self) -> float:
        """Mean seconds per operation."""
        return self.io_seconds / self.ios

    @property
    def in_flight(self) -> float:
        """Mean operations in flight while the tier was busy."""
        return self.io_seconds / self.seconds


class _Phase(enum.Enum):
    MEASURE = "measure"
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


class DepthController:
    """Hill climbing on windows of completed operations; see the module's docstring.

    Pure: :meth:`observe` takes one window and returns the depth to run at next,
    nothing else goes in. A window run at another depth than the current one (cut
    across a change) is ignored.
    """

    __slots__ = (
        "_base",
        "_blown",
        "_bold",
        "_climbed",
        "_held",
        "_leapt",
        "_phase",
        "_slow",
        "depth",
        "limits",
    )

    def __init__(self, limits: DepthRange) -> None:
        self.limits = limits
        #: The depth to run at.
        self.depth = limits.start
        self._phase = _Phase.MEASURE
        #: The accepted window: what probes are compared with.
        self._base: IoWindow | None = None
        #: Whether this probe up already kept a step (a failed step then ends the climb
        #: instead of trying the other way).
        self._climbed = False
        #: Whether the last step up paid almost in proportion: the next one doubles.
        self._bold = False
        #: Whether the accepted depth was reached by such a doubling (the depths it
        #: leapt over were never measured).
        self._leapt = False
        self._held = 0
        #: Blown-up windows in a row.
        self._slow = 0
        #: The last blown-up window, until the halved depth's first window is measured.
        self._blown: IoWindow | None = None

    def observe(self, window: IoWindow) -> int:
        """Take one window; the depth to run at from now on."""
        if (
            self.limits.is_fixed
            or window.depth != self.depth
            or window.ios <= 0
            or window.seconds <= 0
            or window.bytes <= 0
        ):
            return self.depth
        base = self._base
        if base is not None and self._blown_up(window, base):
            if self.depth == self.limits.minimum:
                # Nothing to halve: each operation costs more than it did, and only
                # more of them at once can hide that. Measure from here, trying up.
                self._slow = 0
                return self._probe_from(window)
            self._slow += 1
            return self._back_off(window) if self._slow >= BLOWUP_WINDOWS else self.depth
        self._slow = 0
        if window.in_flight < SATURATED * window.depth:
            if self._phase is _Phase.UP:
                # The added depth went unused: nothing says it helps.
                return self._hold_at(base)
            return self.depth
        match self._phase:
            case _Phase.MEASURE:
                blown, self._blown = self._blown, None
                if blown is not None and _earns_its_depth(window, blown):
                    # The halved depth lost what the depth it left gave: the device
                    # did not slow, each operation costs more (a busy CPU, files
                    # removed nearby), and more at once hide that. Climb, boldly.
                    self._climbed, self._bold = True, True
                    return self._probe_up_from(blown) or self._hold_at(blown)
                return self._probe_from(window)
            case _Phase.UP:
                assert base is not None
                if _earns_its_depth(base, window):
                    self._climbed = True
                    self._leapt = window.depth > self._step_up(base.depth)
                    self._bold = _gain_share(base, window) >= BOLD_GAIN
                    return self._probe_up_from(window) or self._hold_at(window)
                if self._climbed and not self._leapt:
                    return self._hold_at(base)
                # Down from a depth a doubling reached: the knee may lie below it.
                return self._probe_down_from(base) or self._hold_at(base)
            case _Phase.DOWN:
                assert base is not None
                if not _earns_its_depth(window, base):
                    return self._probe_down_from(window) or self._hold_at(window)
                return self._hold_at(base)
            case _Phase.HOLD:
                assert base is not None
                self._held += 1
                drift = window.throughput / base.throughput - 1
                if drift < -DRIFT and window.latency > base.latency:
                    # Slower at the same depth, each operation longer: if more at once
                    # hide what each now costs, a doubling finds it in one window (and
                    # steps back down from there if not).
                    return self._probe_from(window, bold=True)
                if self._held >= HOLD_WINDOWS or abs(drift) > DRIFT:
                    return self._probe_from(window)
                return self.depth

    # ----------------------------------------------------------------- moves

    def _probe_from(self, window: IoWindow, bold: bool = False) -> int:
        """``window`` is the accepted depth's measure: try a step up (a doubling if
        ``bold``), else down."""
        self._climbed = self._leapt = False
        self._bold = bold
        return self._probe_up_from(window) or self._probe_down_from(window) or self._hold_at(window)

    def _probe_up_from(self, window: IoWindow) -> int | None:
        target = self._step_up(window.depth, self._bold)
        if target == window.depth:
            return None
        return self._go(_Phase.UP, window, target)

    def _probe_down_from(self, window: IoWindow) -> int | None:
        target = self._step_down(window.depth)
        if target == window.depth:
            return None
        return self._go(_Phase.DOWN, window, target)

    def _hold_at(self, window: IoWindow | None) -> int:
        if window is None:  # unsaturated before anything was accepted: measure again
            self._phase = _Phase.MEASURE
            return self.depth
        self._held = 0
        return self._go(_Phase.HOLD, window, window.depth)

    def _back_off(self, blown: IoWindow) -> int:
        self._slow = 0
        self._blown = blown
        self._base = None
        self._phase = _Phase.MEASURE
        self.depth = max(self.limits.minimum, self.depth // 2)
        return self.depth

    def _go(self, phase: _Phase, base: IoWindow, depth: int) -> int:
        self._phase = phase
        self._base = base
        self.depth = depth
        return depth

    # ------------------------------------------------------------------ rules

    def _step_up(self, depth: int, bold: bool = False) -> int:
        # Steps of about a quarter: small enough that a knee is not jumped over, large
        # enough that the gain of one step stands out of a window's noise. A bold step
        # doubles: the last one paid nearly in proportion, so the knee is further up.
        if bold:
            return min(self.limits.maximum, 2 * depth)
        return min(self.limits.maximum, depth + max(1, depth // 4))

    def _step_down(self, depth: int) -> int:
        return max(self.limits.minimum, depth - max(1, depth // 4))

    @staticmethod
    def _blown_up(window: IoWindow, base: IoWindow) -> bool:
        # More depth makes each operation wait behind more others: that share of the
        # latency is the queue's, not the device's.
        queued = max(1.0, window.depth / base.depth)
        return window.latency > BLOWUP * base.latency * queued


def _gain_share(lower: IoWindow, higher: IoWindow) -> float:
    """What share of ``higher``'s added depth its throughput gained over ``lower``'s
    (1: in proportion)."""
    added = higher.depth / lower.depth - 1
    return (higher.throughput / lower.throughput - 1) / added


def _earns_its_depth(lower: IoWindow, higher: IoWindow) -> bool:
    """Whether ``higher``'s extra depth paid: throughput grew by :data:`GAIN_SHARE` of
    the added depth, and latency by no more than queueing at that gain explains."""
    added = higher.depth / lower.depth - 1
    gain = higher.throughput / lower.throughput - 1
    # Little's law: latency = depth / throughput, so the least acceptable gain allows
    # latency to grow by (1 + added) / (1 + GAIN_SHARE * added).
    allowed_latency = lower.latency * (1 + added) / (1 + GAIN_SHARE * added)
    return gain >= GAIN_SHARE * added and higher.latency <= allowed_latency


def window_ios(depth: int) -> int:
    """Completed operations a window at ``depth`` waits for (and :data:`MIN_WINDOW_S`)."""
    return max(MIN_WINDOW_IOS, WINDOW_TURNS * depth)


class IoMeter:
    """Counts of one direction's completed operations, updated from its threads.

    A thread calls :meth:`run_started` before an operation (or a run of them) and
    :meth:`run_ended` after it (busy time is the union of such runs), and
    :meth:`io_done` after each operation. :meth:`take` (any thread; the tiers call it
    on their loop) closes the window.
    """

    __slots__ = (
        "_active",
        "_busy",
        "_busy_since",
        "_bytes",
        "_io_seconds",
        "_lock",
        "clock",
        "ios",
    )

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        #: The clock operations are timed with (the threads read it too).
        self.clock = clock
        self._lock = threading.Lock()
        self._active = 0
        self._busy_since = 0.0
        self._busy = 0.0
        self._bytes = 0
        #: Operations completed in the window so far.
        self.ios = 0
        self._io_seconds = 0.0

    def run_started(self) -> None:
        with self._lock:
            if self._active == 0:
                self._busy_since = self.clock()
            self._active += 1

    def run_ended(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._busy += self.clock() - self._busy_since

    def io_done(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._bytes += nbytes
            self.ios += 1
            self._io_seconds += seconds

    def busy_seconds(self) -> float:
        """Seconds of the window so far during which an operation was in flight."""
        with self._lock:
            if self._active:
                return self._busy + self.clock() - self._busy_since
            return self._busy

    def take(self, depth: int) -> IoWindow:
        """The window so far, run at ``depth``; the next one starts now."""
        with self._lock:
            busy = self._busy
            if self._active:
                now = self.clock()
                busy += now - self._busy_since
                self._busy_since = now
            window = IoWindow(depth, self._bytes, busy, self.ios, self._io_seconds)
            self._busy = 0.0
            self._bytes = 0
            self.ios = 0
            self._io_seconds = 0.0
        return window


class IoDepth(BlockingResource):
    """One direction of a tier's I/O: threads whose number in flight follows the device.

    The operations run on :attr:`threads` (:class:`~kvtier.tiers._threads.IoThreads`,
    named ``name``); :attr:`limiter` bounds what else the direction sends to anyio's
    threads (the fs tier's lookups) to the same depth. Fixed ranges keep their depth;
    adaptive ones run a :class:`DepthController` on the meter's windows. ``publish``
    hears every depth taken, the first included (the tiers set a gauge with it).
    Closing lets the threads end once idle, without blocking.
    """

    close_blocks = False

    def __init__(
        self,
        limits: DepthRange,
        publish: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        name: str = "kvtier-io",
    ) -> None:
        self.limits = limits
        self.meter = IoMeter(clock)
        self._controller = None if limits.is_fixed else DepthController(limits)
        self._publish = publish
        self._limiter: anyio.CapacityLimiter | None = None
        self._threads: IoThreads | None = None
        self._name = name

    @property
    def depth(self) -> int:
        """Operations allowed in flight now."""
        return self.limits.start if self._controller is None else self._controller.depth

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        """The anyio thread limiter; :meth:`start` creates it."""
        if self._limiter is None:
            raise RuntimeError("IoDepth.start() was not called")
        return self._limiter

    @property
    def threads(self) -> IoThreads:
        """The direction's threads; :meth:`start` creates them."""
        if self._threads is None:
            raise RuntimeError("IoDepth.start() was not called")
        return self._threads

    def start(self) -> None:
        """Create the limiter (on the tier's event loop) and the threads, and publish
        the first depth."""
        self._limiter = anyio.CapacityLimiter(self.depth)
        self._threads = IoThreads(self._name, self.depth, self.meter)
        if self._publish is not None:
            self._publish(self.depth)

    def close(self) -> None:
        """Let the threads end once idle (the tier is closing)."""
        if self._threads is not None:
            self._threads.close()

    def apply(self, depth: int) -> None:
        """Run at ``depth`` from now on (the controller's decisions; tests)."""
        limiter, threads = self.limiter, self.threads
        if depth == limiter.total_tokens and depth == threads.depth:
            return
        limiter.total_tokens = depth
        threads.depth = depth
        if self._publish is not None:
            self._publish(depth)

    def poll(self) -> None:
        """Close the window if it is full and apply the controller's decision.

        Call it on the loop the limiter belongs to, after operations completed.
        """
        controller, meter = self._controller, self.meter
        if controller is None or meter.ios < window_ios(controller.depth):
            return
        if meter.busy_seconds() < MIN_WINDOW_S:
            return
        self.apply(controller.observe(meter.take(controller.depth)))


def depth_gauge(metrics: MetricsRecorder, tier: str, direction: str) -> Callable[[int], None]:
    """A ``publish`` callback for :class:`IoDepth` that sets ``kvtier_tier_io_depth``
    (declared by :func:`~kvtier.metrics.tier_io_metric_definitions`)."""
    labels = (tier, direction)

    def publish(depth: int) -> None:
        metrics.set(Names.TIER_IO_DEPTH, depth, labels)

    return publish
