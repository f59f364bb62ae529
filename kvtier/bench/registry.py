"""How a tier type joins ``kvtier bench``: one :class:`BenchTier` entry, registered.

An entry says, for one tier type, everything the bench does differently for it:

- ``start``: the ``--tiers NAME`` entry of ``secondary_tiers`` for a run, and any local
  service that entry needs (an S3 server, a peer engine), started for the run and
  stopped after it;
- ``measure``: the physical limit the tier is held against, measured in the same run;
- ``limits``: the rows that measurement gives: a figure in the report's ``physical``,
  and the tier's ``ratios`` to it;
- ``above_limit``: why the tier may still move data faster than its limit (the page
  cache, for a tier whose I/O goes through it), printed beside a ratio above 1.

For example, a tier kept in RAM, held against a plain memory copy::

    @contextlib.asynccontextmanager
    async def start(settings: BenchSettings, workspace: Path) -> AsyncIterator[LocalTier]:
        yield LocalTier({"type": "example"})

    async def measure(tier: SecondaryTier, run: LimitContext) -> dict[Direction, float]:
        return {Direction.READ: await asyncio.to_thread(measure_memcpy)}

    BENCH_TIERS.register(BenchTier(
        "example", ExampleTier, start, measure,
        (Limit(Direction.READ, "memcpy (example)", "example_memcpy_gbps", "example_read"),),
    ))

A tier's entry may live in the tier's own package and join by one line,
``BENCH_TIERS.register_module(name, module_path)``: the module is imported when the
entry is first needed, so it may import the bench itself. The built-in entries are
listed, in table order, in :mod:`kvtier.bench.tiers`.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.settings import BenchSettings
from kvtier.tiers import SecondaryTier

__all__ = [
    "MEMCPY_KEY",
    "AboveLimit",
    "BenchTier",
    "BenchTierRegistry",
    "Direction",
    "Limit",
    "LimitContext",
    "LocalTier",
    "MeasureLimits",
    "StartTier",
    "TierTraffic",
]

#: The key of the one limit measured in every run, whatever its tiers.
MEMCPY_KEY = "memcpy_gbps"
# Each limit is measured with as many chunks as the tier moved, but never so few that
# the timing is noise.
_MIN_MEASURED_CHUNKS = 16


class Direction(enum.Enum):
    """Which way data moves through a tier: what a limit bounds."""

    #: Into the tier (its ``bytes_written``, ``write_gbps``).
    WRITE = "write"
    #: Out of the tier, back into the primary tier (``bytes_read``, ``read_gbps``).
    READ = "read"


@dataclass(frozen=True)
class Limit:
    """One physical limit a tier is held against: a row of the limits table."""

    direction: Direction
    #: The row's label, such as ``"disk write (raw pwritev)"``.
    label: str
    #: The measured GB/s, under this key of the report's ``physical``.
    key: str
    #: The tier's GB/s over the limit, under this key of the report's ``ratios``.
    ratio: str


@dataclass(frozen=True)
class LocalTier:
    """One ``secondary_tiers`` entry a bench tier started for a run."""

    config: dict[str, Any]
    #: Whether the tier built from ``config`` is ready for the run to start (a p2p
    #: tier that has heard of what its peer holds); None: ready once built.
    ready: Callable[[SecondaryTier], bool] | None = None


@dataclass(frozen=True)
class TierTraffic:
    """What one tier moved during the run: bytes, and GB/s while it was moving data."""

    bytes_written: int
    bytes_read: int
    write_gbps: float | None
    read_gbps: float | None

    def gbps(self, direction: Direction) -> float | None:
        return self.write_gbps if direction is Direction.WRITE else self.read_gbps


@dataclass(frozen=True)
class LimitContext:
    """What a limit measurement gets to work with."""

    chunk_bytes: int
    #: The run's working directory (the measurement may use a subdirectory of it).
    workspace: Path
    traffic: TierTraffic
    #: Hears what a long measurement is doing each time that changes ("pass 1 of 3:
    #: writing 1,024 chunks"), so the run shows it moving; called from any thread.
    progress: Callable[[str], None] = field(default=lambda text: None, compare=False)

    def chunks(self, moved: int, cap_bytes: int) -> int:
        """How many chunks to measure with: as many as ``moved`` bytes, up to the cap.

        The same bytes meet the same hardware, without a big run measuring for long.
        """
        return max(_MIN_MEASURED_CHUNKS, min(moved, cap_bytes) // self.chunk_bytes)


#: Starts what a ``--tiers`` name needs for one run (the settings, the run's working
#: directory) and yields its ``secondary_tiers`` entry; stops it on exit.
StartTier = Callable[[BenchSettings, Path], AbstractAsyncContextManager[LocalTier]]
#: Measures the limits of a built tier: GB/s by direction, one per :class:`Limit`.
MeasureLimits = Callable[[SecondaryTier, LimitContext], Awaitable[Mapping[Direction, float]]]
#: Why a built tier may move data faster than its limit that way (a route the raw I/O
#: does not take), or None where there is no such route.
AboveLimit = Callable[[SecondaryTier, Direction], str | None]


@dataclass(frozen=True)
class BenchTier:
    """How the bench runs and measures one tier type.

    ``tier_class`` selects the built tiers this entry measures, subclasses included
    (so a ``secondary_tiers`` list from ``--config`` is measured too); ``name`` is what
    ``--tiers`` calls it.
    """

    name: str
    tier_class: type[SecondaryTier]
    start: StartTier
    measure: MeasureLimits | None = None
    limits: tuple[Limit, ...] = ()
    above_limit: AboveLimit | None = None

    def __post_init__(self) -> None:
        if not self.name or "," in self.name or self.name != self.name.strip():
            raise ValueError(f"a bench tier name must be a word usable in --tiers: {self.name!r}")
        if (self.measure is None) != (not self.limits):
            raise ValueError(f"bench tier {self.name}: limits and measure go together")
        directions = [limit.direction for limit in self.limits]
        if len(set(directions)) != len(directions):
            raise ValueError(f"bench tier {self.name}: one limit per direction")


class BenchTierRegistry:
    """Bench tiers by name, in registration order (the order of the limits table)."""

    def __init__(self, entries: Iterable[BenchTier] = ()) -> None:
        # An entry registered by module is (module path, attribute) until first needed.
        self._entries: dict[str, BenchTier | tuple[str, str]] = {}
        for entry in entries:
            self.register(entry)

    def register(self, entry: BenchTier) -> None:
        """Add ``entry``.

        Raises:
            ValueError: its name or tier class is registered already, or a report key
                of its limits is another entry's.
        """
        if entry.name in self._entries:
            raise ValueError(f"bench tier {entry.name!r} is registered already")
        _check_against(entry, self._loaded())
        self._entries[entry.name] = entry

    def register_module(self, name: str, module_path: str, attribute: str = "BENCH_TIER") -> None:
        """Add the entry called ``name`` that module ``module_path`` defines as
        ``attribute``, imported when an entry is first needed (:meth:`names` imports
        nothing), and then checked as :meth:`register` checks.

        Raises:
            ValueError: ``name`` is registered already.
        """
        if name in self._entries:
            raise ValueError(f"bench tier {name!r} is registered already")
        self._entries[name] = (module_path, attribute)

    def unregister(self, name: str) -> None:
        """Remove the entry called ``name`` (KeyError if there is none)."""
        del self._entries[name]

    def names(self) -> list[str]:
        return list(self._entries)

    def __iter__(self) -> Iterator[BenchTier]:
        return iter(self._all())

    def get(self, name: str) -> BenchTier:
        """The entry ``--tiers`` calls ``name``.

        Raises:
            ValueError: none is registered under ``name``, or its module does not
                define it.
        """
        if name not in self._entries:
            raise ValueError(
                f"unknown tier {name!r} for --tiers; expected some of {', '.join(self._entries)}"
            )
        return next(entry for entry in self._all() if entry.name == name)

    def for_class(self, tier_class: type[SecondaryTier]) -> BenchTier | None:
        """The entry measuring tiers of ``tier_class``: its own, else its nearest base's."""
        by_class = {entry.tier_class: entry for entry in self._all()}
        return next((by_class[c] for c in tier_class.__mro__ if c in by_class), None)

    def limits(self) -> list[Limit]:
        """Every entry's limits, in registration order."""
        return [limit for entry in self._all() for limit in entry.limits]

    def _loaded(self) -> list[BenchTier]:
        return [entry for entry in self._entries.values() if isinstance(entry, BenchTier)]

    def _all(self) -> list[BenchTier]:
        """Every entry, in order, importing those registered by module."""
        for name, entry in list(self._entries.items()):
            if isinstance(entry, tuple):
                loaded = _import_entry(name, *entry)
                _check_against(loaded, self._loaded())
                self._entries[name] = loaded
        return self._loaded()


def _import_entry(name: str, module_path: str, attribute: str) -> BenchTier:
    entry = getattr(importlib.import_module(module_path), attribute, None)
    if not isinstance(entry, BenchTier) or entry.name != name:
        raise ValueError(f"{module_path}.{attribute} is not a bench tier called {name!r}")
    return entry


def _check_against(entry: BenchTier, others: Iterable[BenchTier]) -> None:
    """Raise ValueError if ``entry`` takes the tier class or a report key of ``others``."""
    taken = {MEMCPY_KEY}
    for other in others:
        if other.tier_class is entry.tier_class:
            raise ValueError(
                f"{entry.tier_class.__name__} is benchmarked as {other.name!r} already"
            )
        taken.update(key for limit in other.limits for key in (limit.key, limit.ratio))
    for limit in entry.limits:
        for key in (limit.key, limit.ratio):
            if key in taken:
                raise ValueError(f"bench tier {entry.name}: report key {key!r} is taken")
