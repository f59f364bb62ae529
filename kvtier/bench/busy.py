"""A busy host: threads that hold the GIL and a core the way a serving engine's do.

A serving engine is one Python process whose scheduler thread and output and worker
threads run Python much of the time: each holds the GIL for a stretch of bytecode, lets
it go in a blocking call, and comes back. An offloading backend in that process shares
the GIL with them, so a benchmark on an idle process flatters whichever backend does
more of its work in Python. :class:`BusyHost` adds such threads to a benchmark's
process, the same way for every side measured.

Each thread runs in slices of :data:`SLICE_S`: pure Python (no call that releases the
GIL) for its share of the slice, then a sleep for the rest. The GIL is then held for
that share of the time, but for the moments the interpreter hands it to a thread that
asked for it (after ``sys.getswitchinterval()`` at most). :meth:`BusyHost.stop` says
what share of a core the threads actually took (their own CPU time over the wall
clock), which is the figure to report: a loaded machine may give them less.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

__all__ = ["SLICE_S", "BusyHost"]

#: One turn of a busy thread: its share of it in Python, the rest asleep. Ten
#: milliseconds is the order of one scheduler step of an engine at high load.
SLICE_S = 0.01


class BusyHost:
    """``threads`` threads taking ``share`` of one core between them, in Python.

    ``share`` is of one core (0.5: half of one core; 1.5: one and a half). Use it as a
    context manager, or :meth:`start` and :meth:`stop`. Starting it again starts a new
    measure.
    """

    def __init__(self, share: float, threads: int = 1, slice_s: float = SLICE_S) -> None:
        if share < 0:
            raise ValueError(f"share must be at least 0, got {share}")
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        if share / threads > 1:
            raise ValueError(
                f"{threads} thread(s) cannot take {share:g} of a core: at most one core each"
            )
        if slice_s <= 0:
            raise ValueError(f"slice_s must be positive, got {slice_s}")
        self.share = share
        self.thread_count = threads
        self.slice_s = slice_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._cpu_s: list[float] = []
        self._started = 0.0
        #: What the last :meth:`stop` measured: the share of one core the threads took,
        #: and their CPU seconds (to take out of a process's CPU figures).
        self.measured_share = 0.0
        self.cpu_s = 0.0

    @property
    def active(self) -> bool:
        return bool(self._threads)

    def start(self) -> None:
        """Start the threads (none when ``share`` is 0)."""
        if self._threads:
            raise RuntimeError("the busy host is running already")
        self._stop.clear()
        self._cpu_s = []
        self._started = time.perf_counter()
        if self.share == 0:
            return
        busy_s = self.slice_s * self.share / self.thread_count
        for index in range(self.thread_count):
            thread = threading.Thread(
                target=self._spin, args=(busy_s,), name=f"busy-host-{index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self) -> float:
        """Stop the threads; the share of one core they took since :meth:`start`."""
        wall = time.perf_counter() - self._started
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._threads = []
        self.cpu_s = sum(self._cpu_s)
        self.measured_share = self.cpu_s / wall if wall > 0 else 0.0
        return self.measured_share

    def _spin(self, busy_s: float) -> None:
        stop, clock, slice_s = self._stop, time.perf_counter, self.slice_s
        cpu = time.thread_time()
        total = 0
        while not stop.is_set():
            began = clock()
            until = began + busy_s
            while clock() < until:
                # Bytecode only: the GIL stays with this thread until asked for.
                for step in range(100):
                    total += step
            rest = slice_s - (clock() - began)
            if rest > 0:
                stop.wait(rest)
        self._cpu_s.append(time.thread_time() - cpu)

    def __enter__(self) -> BusyHost:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
