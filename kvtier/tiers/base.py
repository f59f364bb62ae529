"""The secondary-tier interface: a tier is an async class that moves bytes.

A tier sits behind the primary tier: it stores chunks the primary tier cascades to it
and loads chunks back into primary slots when a lookup finds them there. The framework
(:mod:`kvtier.tiering`) owns everything else: it runs each job as a task on the tier
event loop, bounds how many run at once, times them out, turns exceptions into failed
results, batches and caches lookups, measures bytes and seconds, applies back-pressure
and drains the tier on shutdown. A tier is just I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from kvtier.config import ConfigReader
from kvtier.keys import OffloadKey
from kvtier.metrics import MetricDefinition, MetricsRecorder
from kvtier.records import HitSource, Locality, Medium, OffloadingEvent
from kvtier.region import PrimaryView
from kvtier.resources import AsyncResource

__all__ = [
    "JobResult",
    "PinBackend",
    "PrimaryAccess",
    "SecondaryTier",
    "TierContext",
    "TierCounters",
    "TierSettings",
    "TransferJob",
]


@dataclass(frozen=True)
class TransferJob:
    """One batch of chunks for a tier to move.

    For a store (cascade) the slots ``chunk_ids[i]`` hold the bytes of ``keys[i]`` and
    stay pinned until the job ends. For a load (promotion, ``is_promotion``) the slots
    are allocated for ``keys[i]`` and the tier writes into them; nobody reads them
    before the job ends.
    """

    job_id: int
    keys: tuple[OffloadKey, ...]
    chunk_ids: tuple[int, ...]
    is_promotion: bool
    req_id: str


@dataclass(frozen=True)
class JobResult:
    """What a tier reports for one job.

    ``successful_keys`` (loads only) names the keys that were loaded when only some
    were; None means all keys share the fate ``success`` says. ``transfer_bytes`` and
    ``transfer_time`` default to the framework's own measurement.
    """

    job_id: int
    success: bool
    successful_keys: Sequence[OffloadKey] | None = None
    transfer_bytes: int | None = None
    transfer_time: float | None = None


class PinBackend(Protocol):
    """The manager's side of :class:`PrimaryAccess` (it owns the primary tier's state)."""

    def request_pins(
        self,
        keys: tuple[OffloadKey, ...],
        future: asyncio.Future[dict[OffloadKey, memoryview]],
    ) -> None:
        """Pin the readable ``keys`` soon and resolve ``future`` with their rows.

        If ``future`` is done by then (its waiter gave up), release what was pinned.
        """

    def release_pins(self, keys: tuple[OffloadKey, ...]) -> None:
        """Release pins taken for a tier. Never blocks; safe from any thread."""


class PrimaryAccess:
    """Lets a tier read chunks of this node's primary tier, pinned while it reads.

    For tiers that serve this node's primary tier to others (p2p). :meth:`pin` asks the
    manager (the only writer of primary state) to pin the keys that are readable now;
    it answers with their rows. Every key pinned must be released with :meth:`unpin`;
    :meth:`pinned` does both around a block.
    """

    def __init__(self, view: PrimaryView) -> None:
        self.view = view
        self._backend: PinBackend | None = None

    def bind(self, backend: PinBackend) -> None:
        """Connect to the manager that owns the primary tier (done by the manager)."""
        self._backend = backend

    async def pin(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, memoryview]:
        """Pin the readable ``keys``; returns the row of each key that was pinned."""
        if self._backend is None:
            raise RuntimeError("this tier's primary access is not bound to a manager")
        future: asyncio.Future[dict[OffloadKey, memoryview]] = (
            asyncio.get_running_loop().create_future()
        )
        self._backend.request_pins(tuple(keys), future)
        try:
            return await future
        except asyncio.CancelledError:
            # Cancelled after the manager pinned but before this task resumed: the rows
            # would stay pinned forever. (If the future itself was cancelled, the manager
            # releases what it pins when it finds nobody waiting.)
            if future.done() and not future.cancelled():
                self.unpin(list(future.result()))
            raise

    def unpin(self, keys: Sequence[OffloadKey]) -> None:
        """Release pins :meth:`pin` took. Never blocks; safe from any thread."""
        if keys and self._backend is not None:
            self._backend.release_pins(tuple(keys))

    @contextlib.asynccontextmanager
    async def pinned(
        self, keys: Sequence[OffloadKey]
    ) -> AsyncIterator[dict[OffloadKey, memoryview]]:
        rows = await self.pin(keys)
        try:
            yield rows
        finally:
            self.unpin(list(rows))


class TierCounters:
    """Counts a tier reports from its coroutines; the manager flushes them each step."""

    __slots__ = ("integrity_failures",)

    def __init__(self) -> None:
        self.integrity_failures = 0


@dataclass(frozen=True)
class TierContext:
    """What the framework gives a tier.

    ``primary_view[chunk_id]`` is the whole row of that primary slot, a writable
    memoryview over the shared region (no copy). ``chunk_bytes`` is the length of every
    row. ``namespace`` names the identity of the bytes (model, dtype, geometry, format);
    a tier must never serve bytes stored under another namespace.
    """

    primary_view: PrimaryView
    chunk_bytes: int
    namespace: str
    tier_name: str
    #: The key path of this tier's configuration, e.g. ``secondary_tiers[1]``.
    config_path: str = "secondary_tiers[0]"
    model_name: str = ""
    metrics: MetricsRecorder = field(default_factory=lambda: MetricsRecorder({}))
    counters: TierCounters = field(default_factory=TierCounters)
    #: Pinned reads of this node's primary tier, for tiers that serve it to others.
    primary: PrimaryAccess | None = None
    #: Whether the host takes events (``enable_kv_events``): a tier that records them
    #: otherwise would grow its log forever. ``EventLog(ctx.enable_events)`` obeys it.
    enable_events: bool = False
    #: The framework's time-out for one job of this tier; a tier that bounds its own
    #: retries ends them well before it.
    job_timeout_s: float = 30.0
    #: The configuration's ``type`` as written (a registered name or a class name).
    tier_type: str = ""
    #: The host's own spec object for this engine, where the host has one (vLLM's
    #: ``OffloadingSpec`` under vLLM): for tiers written against a host's interface.
    host_spec: Any = None

    def read(self, params: Mapping[str, Any]) -> ConfigReader:
        """A reader over this tier's parameters whose errors name ``config_path``."""
        return ConfigReader(params, self.config_path)

    def report_integrity_failure(self, count: int = 1) -> None:
        """Count stored chunks found corrupt, truncated or foreign (and not served)."""
        self.counters.integrity_failures += count


class TierSettings(Protocol):
    """A tier's parameters, parsed and checked: a frozen dataclass by convention.

    ``from_params`` reads the tier's keyword parameters (the framework's own keys
    removed), raises :class:`~kvtier.ConfigError` naming ``path.key`` for a bad or
    unknown one, and opens nothing: it runs whenever a configuration is checked.
    """

    @classmethod
    def from_params(cls, params: Mapping[str, Any], path: str) -> Any: ...


class SecondaryTier(AsyncResource):
    """One tier behind the primary tier.

    Subclasses set :attr:`medium` (and :attr:`hit_source` where the medium does not
    say it), implement :meth:`lookup`, :meth:`store` and :meth:`load`, and declare
    their parameters as a :class:`TierSettings` record named in :attr:`settings_class`.
    The framework then parses a configuration once, before anything is built
    (:meth:`check_params`), fills in what the tier derives from the engine
    (:meth:`effective_settings`), and builds the tier from that record::

        class MyTier(SecondaryTier):
            settings_class = MySettings

            def __init__(self, ctx: TierContext, settings: MySettings) -> None:
                super().__init__(ctx)
                self.settings = settings

    A tier whose ``__init__`` takes no ``settings`` is built with its parameters as
    keyword arguments instead, ``tier_class(ctx, **params)`` (``type``,
    ``module_path`` and the framework's own keys never reach it): the form for a
    tier without a ``settings_class``, and the one plugins written before records
    used. :meth:`settings_for` gives the record for a tier built by hand.

    Every coroutine runs on the tier event loop and must never block it: file and
    checksum work goes to a thread (``anyio.to_thread.run_sync`` with a bounded
    limiter), network work to async I/O. A tier never touches manager state; it only
    reads and writes the primary slots of the job it is running. Raising from
    :meth:`store` or :meth:`load` fails the job (a counted miss), as does exceeding
    the job timeout; the framework logs it once with context. :mod:`kvtier.tiers.kit`
    holds what every real tier needs besides (a deadline under the job timeout,
    throttled logs, secrets, corrupt-chunk handling).

    A job that exceeds its timeout is reported failed at once and cancelled through
    an anyio cancel scope; its slots stay out of use until its coroutine has returned.
    A call in ``anyio.to_thread.run_sync`` (which is why it is the way to use threads
    here) finishes before the coroutine returns, so a late thread never writes into a
    slot that another chunk took. Threads started any other way (``asyncio.to_thread``,
    ``run_in_executor``, a thread of the tier's own) are not waited for: a tier using
    them must stop them touching the job's slots before its coroutine returns.
    """

    #: Where the tier keeps its bytes (in events, and what the vLLM adapter reports).
    medium: ClassVar[Medium] = Medium.STORAGE
    #: Where a host is told a chunk loaded from this tier came from (vLLM's
    #: ``CacheHitSource``). A class that sets :attr:`medium` and not this gets its
    #: medium's (:meth:`HitSource.of <kvtier.records.HitSource.of>`).
    hit_source: ClassVar[HitSource] = HitSource.DISK
    #: On this node or across a network; picks the default back-pressure water marks
    #: and promotion budget (a plain ``"local"`` / ``"remote"`` is read as the member).
    locality: ClassVar[Locality | str] = Locality.LOCAL
    #: Whether a chunk the tier stored is a copy of its own, kept when the primary tier
    #: lets the chunk go. A tier that only serves the primary tier to others (p2p) keeps
    #: none: a host that acknowledges a chunk only once it has a lasting copy (SGLang's
    #: ``buffer_only`` host memory) does not count such a tier's store.
    keeps_copies: ClassVar[bool] = True
    #: Keys the framework reads (``locality``, ``enable_kv_events``) that this tier
    #: also receives among its own parameters, as written, where they are given.
    shared_keys: ClassVar[tuple[str, ...]] = ()
    #: The parsed form of this tier's parameters; None for a tier that reads its
    #: keyword arguments itself.
    settings_class: ClassVar[type[TierSettings] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A class that sets its medium and no source reports its medium's; one that
        # sets neither keeps what it inherits.
        if "medium" in cls.__dict__ and "hit_source" not in cls.__dict__:
            cls.hit_source = HitSource.of(cls.medium)

    def __init__(self, ctx: TierContext, **params: Any) -> None:
        self.ctx = ctx

    @classmethod
    def check_params(cls, params: Mapping[str, Any], path: str) -> Any:
        """Check the tier's parameters without building anything.

        Returns the parsed :attr:`settings_class` object, or None for a tier without one.

        Raises:
            ConfigError: a parameter is missing, invalid or unknown (named by its path).
        """
        if cls.settings_class is None:
            return None
        return cls.settings_class.from_params(params, path)

    @classmethod
    def effective_settings(
        cls, settings: Any, *, chunk_bytes: int, job_timeout_s: float, path: str
    ) -> Any:
        """``settings`` (from :meth:`check_params`) as the tier will run with them.

        A tier that derives values from the framework's (a deadline from
        ``job_timeout_s``, a limit from ``chunk_bytes``, the length of a primary row)
        fills them in here, once: the tier is built from the record this returns, and
        a configuration check (``kvtier plan``) shows and checks them without building
        the tier. Opens nothing.

        Raises:
            ConfigError: a value that does not fit ``chunk_bytes`` or ``job_timeout_s``
                (named by its path under ``path``).
        """
        return settings

    @classmethod
    def settings_for(cls, ctx: TierContext, params: Mapping[str, Any]) -> Any:
        """The effective settings ``params`` give a tier built with ``ctx``: parsed
        (:meth:`check_params`) and derived (:meth:`effective_settings`) as the
        framework does. For a tier built by hand: ``MyTier(ctx, MyTier.settings_for(ctx,
        {...}))``. None for a tier without a :attr:`settings_class`.

        Raises:
            ConfigError: a parameter is missing, invalid or unknown, or does not fit
                the engine (named by its path under ``ctx.config_path``).
        """
        settings = cls.check_params(params, ctx.config_path)
        if settings is None:
            return None
        return cls.effective_settings(
            settings,
            chunk_bytes=ctx.chunk_bytes,
            job_timeout_s=ctx.job_timeout_s,
            path=ctx.config_path,
        )

    async def start(self) -> None:
        """Open connections or scan an index. Raising aborts the manager's start."""

    @abstractmethod
    async def lookup(self, keys: Sequence[OffloadKey]) -> Sequence[bool]:
        """Whether each key can be loaded from this tier now (one answer per key)."""

    @abstractmethod
    async def store(self, job: TransferJob) -> JobResult:
        """Copy the pinned slots ``job.chunk_ids`` into the tier under ``job.keys``."""

    @abstractmethod
    async def load(self, job: TransferJob) -> JobResult:
        """Copy ``job.keys`` from the tier into the slots ``job.chunk_ids``.

        Every byte written into a slot must be verified before the job reports it as
        loaded: a key whose bytes cannot be verified is a failed key, never served.
        """

    def contains(self, key: OffloadKey) -> bool | None:
        """Answer a lookup at once from memory: True, False, or None to ask :meth:`lookup`.

        Runs on the scheduler's thread, on its hot path: it must be a dictionary probe,
        never I/O.
        """
        return None

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Record a use of ``keys`` for the tier's own eviction. Runs on the scheduler's
        thread: in-memory bookkeeping only."""

    def on_request_finished(self, req_id: str) -> None:
        """The request left the scheduler and none of its stores is pending any more."""

    def on_primary_removed(self, keys: Sequence[OffloadKey]) -> None:
        """``keys`` left the primary tier (evicted or reset).

        For tiers that serve the primary tier to others. Called by the manager from the
        scheduler's thread, under its lock: record and return, never block.
        """

    def take_events(self) -> list[OffloadingEvent]:
        """Store and removal events of this tier since the last call."""
        return []

    async def clear(self) -> bool:
        """Drop every chunk this tier holds for its namespace; whether it did.

        Runs when the host asks for all of its cache to go (SGLang's clear-storage
        request), once no job of this tier is in flight, bounded by ``job_timeout_s``.
        Removals are reported through :meth:`take_events`. The default keeps everything
        and answers False: a tier that cannot drop its chunks says so.
        """
        return False

    async def aclose(self) -> None:
        """Release connections and files. Jobs have drained when this is called.

        Called once by the framework; a tier used on its own may be closed again, so
        keep it idempotent.
        """

    @classmethod
    def build_metric_definitions(cls, settings: Any) -> dict[str, MetricDefinition]:
        """Metrics this tier records through ``ctx.metrics``, by name.

        ``settings`` is the tier's parsed parameters (:meth:`check_params`; None for a
        tier without a :attr:`settings_class`). A process that declares metrics without
        an engine (vLLM's API server) has no chunk size, so what
        :meth:`effective_settings` derives from it is not filled in.
        """
        return {}
