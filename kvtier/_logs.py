"""Logging a recurring failure once, then a count of its repeats.

A dead server or a full disk fails every job; one line per job would drown the log.
:class:`ThrottledLog` writes the first occurrence of each kind of problem with its
context and then at most one line per interval, carrying how many it held back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["ThrottledLog", "describe_error"]

# A failing tier then writes about one line every ten seconds per kind of problem:
# enough to see it is still failing, few enough to read the rest of the log.
DEFAULT_INTERVAL_S = 10.0


class ThrottledLog:
    """Warnings about one component (``label``), at most one per kind per interval."""

    def __init__(
        self,
        logger: logging.Logger,
        label: str,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._label = label
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(
        self,
        kind: str,
        message: str,
        *args: object,
        exc_info: BaseException | None = None,
    ) -> None:
        """Log ``message % args`` unless ``kind`` was logged within the interval."""
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval_s:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        suppressed = self._suppressed.pop(kind, 0)
        text = "%s: " + message
        if suppressed:
            text += " (%d more like it since the last report)"
            args = (*args, suppressed)
        self._logger.warning(text, self._label, *args, exc_info=exc_info)


def describe_error(exc: BaseException) -> str:
    """A one-line description of ``exc`` for a log line or a failure reason."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
