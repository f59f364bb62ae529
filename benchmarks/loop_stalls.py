"""Where the event loop was when it stalled: ``kvtier bench`` with a watchdog on its loop.

Runs ``kvtier bench`` with the arguments given. While the workload replays, a callback
on the bench's event loop stamps a heartbeat every half millisecond, and a watchdog
thread checks it every millisecond. When the heartbeat is more than ``--stall-ms`` old,
the watchdog reads the loop thread's stack once and files the stall under its
innermost frame and the kvtier frames above it, with the thread's state in the kernel
(Linux: ``R`` runnable, ``S`` sleeping, and where it sleeps), and counts the other
threads of the process that were runnable at that moment, by name.

How to read the table: a stall whose innermost frame is ``select`` found the loop with
no callback of its own running. State ``R`` there: its timer was due and the thread
was ready to run, but had no core (the runnable threads listed were using them);
``S futex...``: it waited for the interpreter lock. Any other frame is work the loop
itself was doing: a callback too long for the loop, to be moved off it.

    python benchmarks/loop_stalls.py --workload cold-warm --duration 30
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import kvtier.bench.run
from kvtier.cli import main as kvtier_main

HEARTBEAT_S = 0.0005
WATCH_S = 0.001


class Watchdog:
    """A heartbeat on one loop, and a thread that reads that loop's stack when it stops."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.stalls: collections.Counter[tuple[str, str]] = collections.Counter()
        #: Other threads found runnable at a stall, by name (numbered pools as one).
        self.runnable: collections.Counter[str] = collections.Counter()
        self.beats = 0
        self._beat = time.perf_counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._native_id = 0
        self._watching = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._loop_thread = loop, threading.get_ident()
        self._native_id = threading.get_native_id()
        self._beat = time.perf_counter()
        self._watching = True
        loop.call_soon(self._heartbeat)
        threading.Thread(target=self._watch, name="loop-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._watching = False

    def _heartbeat(self) -> None:
        self._beat = time.perf_counter()
        self.beats += 1
        if self._watching and self._loop is not None:
            self._loop.call_later(HEARTBEAT_S, self._heartbeat)

    def _watch(self) -> None:
        while self._watching:
            time.sleep(WATCH_S)
            beat = self._beat
            if time.perf_counter() - beat <= self.stall_s:
                continue
            frame = sys._current_frames().get(self._loop_thread)
            if frame is None:
                continue
            leaf, above = _where(traceback.extract_stack(frame))
            self.stalls[(f"{leaf} [{_kernel_state(self._native_id)}]", above)] += 1
            self._count_runnable()
            while self._watching and self._beat == beat:  # one count per stall
                time.sleep(WATCH_S / 2)

    def _count_runnable(self) -> None:
        names = {thread.native_id: thread.name for thread in threading.enumerate()}
        skip = {self._native_id, threading.get_native_id()}  # the loop's, and this one
        with contextlib.suppress(OSError):
            for tid in os.listdir("/proc/self/task"):
                if int(tid) not in skip and _kernel_state(int(tid)).startswith("R"):
                    name = names.get(int(tid), "other")
                    self.runnable[re.sub(r"[_-]?\d+$", "", name)] += 1


def _kernel_state(tid: int) -> str:
    """A thread's scheduler state and the kernel function it sleeps in (Linux only)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/self/task/{tid}/wchan") as wchan:
            where = wchan.read().strip()
    except (OSError, IndexError):
        return "?"
    return state if where in ("", "0") else f"{state} {where}"


def _where(stack: traceback.StackSummary) -> tuple[str, str]:
    leaf = stack[-1]
    ours = [f for f in stack[:-1] if "/kvtier/" in f.filename]
    above = " < ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(ours[-3:]))
    return f"{_short(leaf.filename)}:{leaf.lineno} {leaf.name}", above


def _short(path: str) -> str:
    return "/".join(path.split("/")[-2:])


def watched(replay: Callable[..., Any], watchdog: Watchdog) -> Callable[..., Any]:
    """``replay`` with the watchdog on while it runs."""

    async def run(*args: Any, **kwargs: Any) -> Any:
        watchdog.start(asyncio.get_running_loop())
        try:
            return await replay(*args, **kwargs)
        finally:
            watchdog.stop()

    return run


def main(argv: list[str]) -> int:
    stall_ms = 4.0
    if "--stall-ms" in argv:
        at = argv.index("--stall-ms")
        stall_ms = float(argv[at + 1])
        del argv[at : at + 2]
    watchdog = Watchdog(stall_ms / 1000)
    kvtier.bench.run.replay = watched(kvtier.bench.run.replay, watchdog)
    code = kvtier_main(["bench", "--quiet", *argv])
    total = sum(watchdog.stalls.values())
    print(f"\nloop stalls over {stall_ms:g} ms while replaying: {total} ({watchdog.beats} beats)")
    idle = sum(n for (leaf, _), n in watchdog.stalls.items() if " select [" in leaf)
    ready = sum(n for (leaf, _), n in watchdog.stalls.items() if " select [R" in leaf)
    if total:
        print(
            f"  {idle} ({idle / total:.0%}) with no callback running, {ready} of them "
            f"({ready / total:.0%}) runnable and waiting for a core"
        )
    for (leaf, above), count in watchdog.stalls.most_common(15):
        print(f"  {count:5d}  {leaf}" + (f"  <  {above}" if above else ""))
    if total:
        census = ", ".join(f"{name} {n / total:.1f}" for name, n in watchdog.runnable.most_common())
        print(f"other threads runnable, per stall: {census or 'none'}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
