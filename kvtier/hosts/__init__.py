"""The host layer: what every host of kvtier is a thin shell over.

A *host* is whatever drives the manager for an engine: the async facade
(:class:`~kvtier.KVTier`), the thread-facing :class:`PageStore` (which SGLang's
backend wraps), a benchmark's scheduler loop. They all need the same few things, and
each lives here once:

- :mod:`~kvtier.hosts.fence`: operations side by side, a reset, clear or close alone,
  from asyncio tasks and from threads (:class:`Fence`);
- :mod:`~kvtier.hosts.waits`: step until what the host waits for holds or its deadline
  passes, waiting for completions after the manager's completion mark
  (:func:`step_until`, :func:`step_until_blocking`);
- :mod:`~kvtier.hosts.stores`: store when there is room (:class:`StoreRoom`);
- :mod:`~kvtier.hosts.requests`: request lifetimes, claims and leases
  (:class:`Requests`);
- :mod:`~kvtier.hosts.pages`: kvtier as a store of fixed-size pages for a synchronous
  engine (:class:`PageStore`).
"""

from kvtier.hosts.fence import Fence
from kvtier.hosts.pages import IOSample, PageStore, Segment
from kvtier.hosts.requests import Requests
from kvtier.hosts.stores import StoreRoom
from kvtier.hosts.waits import Step, step_until, step_until_blocking

__all__ = [
    "Fence",
    "IOSample",
    "PageStore",
    "Requests",
    "Segment",
    "Step",
    "StoreRoom",
    "step_until",
    "step_until_blocking",
]
