"""Where the event loop was when it stalled: ``kvtier bench`` with a watchdog on its loop.

Runs ``kvtier bench`` with the arguments given. While the workload replays, a callback
on the bench's event loop stamps a heartbeat every half millisecond, and a watchdog
thread checks it every millisecond. When the heartbeat is more than ``--stall-ms`` old,
the watchdog reads the loop thread's stack once and files the stall under its
innermost frame and the kvtier frames above it.

How to read the table: a stall whose innermost frame is ``select`` found the loop
idle, waiting in the selector: its timer was due, but the thread did not get a core
or the interpreter lock back in time (other threads held them). Any other frame is
work the loop itself was doing: a callback too long for the loop, to be moved off it.

    python benchmarks/loop_stalls.py --workload cold-warm --duration 30
"""

from __future__ import annotations

import asyncio
import collections
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
        self.beats = 0
        self._beat = time.perf_counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._watching = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._loop_thread = loop, threading.get_ident()
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
            self.stalls[_where(traceback.extract_stack(frame))] += 1
            while self._watching and self._beat == beat:  # one count per stall
                time.sleep(WATCH_S / 2)


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
    idle = sum(n for (leaf, _), n in watchdog.stalls.items() if leaf.endswith(" select"))
    if total:
        print(f"  {idle} of them ({idle / total:.0%}) with the loop idle in its selector")
    for (leaf, above), count in watchdog.stalls.most_common(15):
        print(f"  {count:5d}  {leaf}" + (f"  <  {above}" if above else ""))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
