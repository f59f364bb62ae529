"""The ``kvtier`` command line.

- ``kvtier bench`` replays a serving workload through the whole stack and reports hit
  rates, throughput and tail latency against the hardware measured in the same run.
- ``kvtier inspect ROOT_DIR`` lists what an fs tier holds, and with ``--verify`` checks
  every chunk file's checksum.
- ``kvtier plan`` checks a configuration and prints the primary region it describes.

Reports go to stdout; progress, warnings and errors to stderr (without a terminal, a
flushed line per phase). A bad argument or configuration is one line on stderr and exit
code 2; a reader that stops early (``| head``) ends the command quietly with code 141,
as SIGPIPE would.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Sequence

from kvtier.cli._args import build_parser

__all__ = ["main"]


#: The exit code of a command whose reader went away (``kvtier plan --json | head``):
#: what a shell reports for a process ended by SIGPIPE, as ``yes | head`` gives.
#: Not 1, which ``kvtier inspect --verify`` and ``kvtier bench`` give for bad chunks.
_SIGPIPE_EXIT = 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        code = _handler(args.command)(args)
        # Inside the try: a reader that left early breaks the pipe here, not in the
        # flush at exit, where Python could only print a traceback about it.
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        return _SIGPIPE_EXIT
    return code


def _handler(command: str) -> Callable[[argparse.Namespace], int]:
    """The function that runs ``command``, its module imported now: each command
    imports what it needs (``bench`` its replay and torch) and no other command does."""
    if command == "bench":
        from kvtier.cli._bench import bench_command

        return bench_command
    if command == "inspect":
        from kvtier.cli._inspect import inspect_command

        return inspect_command
    from kvtier.cli._plan import plan_command

    return plan_command


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the flush at exit has nowhere to fail.

    What Python's documentation of SIGPIPE advises for a command piped into ``head``.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        # A stdout without a descriptor (a host's stream object) has no exit flush to fail.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
