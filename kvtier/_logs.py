"""Logging a recurring failure once, then a count of its repeats.

A dead server or a full disk fails every job; one line per job would drown the log.
:class:`ThrottledLog` writes the first occurrence of each kind of problem with its
context and then at most one line per interval, carrying how many it held back.

An exception reaches a log record only as text (:func:`describe_failure`), never as
``exc_info``: a record keeps what it holds for as long as a handler keeps the record
(pytest's capture, a ``MemoryHandler``, an error tracker), and an exception's traceback
holds its frames' locals, such as the rows of the shared region a tier was writing.
The region cannot be unmapped while anything holds a row.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable

__all__ = ["ThrottledLog", "describe_error", "describe_failure"]

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
        error: BaseException | None = None,
    ) -> None:
        """Log ``message % args`` unless ``kind`` was logged within the interval.

        ``error``, the exception behind the problem, is written after the message as
        text with its traceback (:func:`describe_failure`); the record does not keep it,
        so a handler that keeps records keeps no frame of the tier that failed.
        """
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
        if error is not None:
            text += ": %s"
            args = (*args, describe_failure(error))
        self._logger.warning(text, self._label, *args)


def describe_error(exc: BaseException) -> str:
    """A one-line description of ``exc`` for a log line or a failure reason."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def describe_failure(exc: BaseException) -> str:
    """``exc`` for a log record: :func:`describe_error`'s line, then its traceback.

    The traceback (chained exceptions included) is formatted now, and then the locals
    of its frames are dropped, so that neither the record nor the exception, wherever
    it is kept, holds what those frames referenced (rows of the shared region, among
    others). Frames still running (the caller's) keep theirs. Call it where ``exc`` is
    handled, on an exception whose frames have all returned to the handler.
    """
    text = "".join(traceback.format_exception(exc)).rstrip("\n")
    _drop_frame_locals(exc)
    return f"{describe_error(exc)}\n{text}"


def _drop_frame_locals(exc: BaseException) -> None:
    """Clear the frames of ``exc``'s traceback and of every exception chained to it."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
        members = getattr(current, "exceptions", None)  # an exception group's
        if isinstance(members, tuple):
            pending.extend(m for m in members if isinstance(m, BaseException))
