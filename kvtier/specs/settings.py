"""``extra_config`` parsed once, into the frozen records everything else reads.

:meth:`SpecSettings.parse` reads the ``extra_config`` of an
:class:`~kvtier.config.OffloadingConfig` into a :class:`SpecSettings`: the primary
tier's keys, the chunk geometry they give, and one :class:`TierConfig` per
``secondary_tiers`` entry (the framework's keys, the tier's ``locality``, and the
tier's own parameters parsed by its ``settings_class`` and derived for the engine).
Every default is filled in where it is written once:
:class:`~kvtier.tiering.runner.RunnerSettings`,
:class:`~kvtier.tiering.backpressure.BackpressureSettings` and
:data:`~kvtier.tiering.backpressure.DEFAULT_MARKS`, each tier's settings class, and the
constants here. The specs build the tiers and their metric definitions from these
records, the vLLM adapter describes the tiers from them and ``kvtier plan`` prints
them, so none of them can disagree.

:class:`MetricSettings` is the part of ``extra_config`` that metric definitions depend
on, parsed by the same readers from ``extra_config`` alone: a process that declares
metrics without an engine (vLLM's API server) declares the engine's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvtier.config import ChunkGeometry, ConfigReader, OffloadingConfig
from kvtier.errors import ConfigError
from kvtier.policies.base import CachePolicy
from kvtier.policies.factory import CachePolicyFactory
from kvtier.records import Locality
from kvtier.tiering.backpressure import BackpressureSettings
from kvtier.tiering.manager import TierOptions
from kvtier.tiering.runner import RunnerSettings
from kvtier.tiers.base import SecondaryTier, TierContext
from kvtier.tiers.factory import SecondaryTierFactory

__all__ = [
    "DEFAULT_EVICTION_POLICY",
    "DEFAULT_MAX_TRACKED_LOOKUPS",
    "LOCAL_PROMOTION_CHUNKS",
    "MetricSettings",
    "SpecSettings",
    "TierConfig",
    "tier_path",
]

DEFAULT_EVICTION_POLICY = "lru"

# Chunks a local tier promotes at once before further promotion jobs wait: enough for
# a disk's deepest useful queue twice over (16 reads in flight: vLLM's read threads,
# and the fs tier's deepest adaptive read depth), so one job's reads can climb to that
# depth and the next request's job is already reading when the last one's final reads
# land (the gap between one job's end and the next one's start would leave the disk
# idle). Jobs still start in request order, so the request admitted first finishes
# first. Measured with benchmarks/vs_vllm.py on the fs tier (2 GiB of 2 MiB chunks,
# 16-chunk requests, 16 waiting): 32 promoted 1.07-1.10 GB/s with request wait p99
# 332-346 ms, against 1.00-1.04 GB/s and 394-397 ms at 8. Remote tiers wait on round
# trips rather than a device: they run as many jobs as max_concurrent_jobs allows.
LOCAL_PROMOTION_CHUNKS = 32

_RUNNER_DEFAULTS = RunnerSettings()

# The store gate's memory of lookup counts: 64,000 keys (vLLM's default too) cost a few
# MiB and cover the prefixes of many thousands of requests between two of their lookups.
DEFAULT_MAX_TRACKED_LOOKUPS = 64_000


def tier_path(index: int) -> str:
    """Where tier ``index``'s mapping sits in ``extra_config``, for error messages."""
    return f"secondary_tiers[{index}]"


@dataclass(frozen=True)
class TierConfig:
    """One ``secondary_tiers`` entry, parsed: how the framework runs the tier, and the
    tier's own parameters."""

    #: Position in ``secondary_tiers`` (lookups ask the tiers in this order).
    index: int
    #: ``secondary_tiers[<index>]``: the prefix of every error about this tier.
    path: str
    #: ``"<index + 1>:<name or type>"``: the tier in metrics, logs and events.
    label: str
    #: ``type`` as written: a registered name or a class name.
    type_name: str
    tier_class: type[SecondaryTier]
    #: ``local`` or ``remote`` (``locality``, else the tier class's): picks the default
    #: water marks and what the vLLM adapter reports.
    locality: Locality
    #: ``max_concurrent_jobs``, ``max_promotion_chunks`` and the time-outs.
    runner: RunnerSettings
    #: The top-level ``backpressure`` merged field by field under the tier's own, water
    #: marks by locality; None: back-pressure is off for this tier.
    backpressure: BackpressureSettings | None
    #: The tier's own parameters as written, read-only: what a tier that reads its
    #: keyword arguments itself receives (``tier_class(ctx, **params)``). Hidden from
    #: ``repr``: they may hold credentials.
    params: Mapping[str, Any] = field(repr=False)
    #: ``params`` parsed by the tier's ``settings_class``, with what the tier derives
    #: from the framework's values filled in (``SecondaryTier.effective_settings``):
    #: the record the tier is built from. None for a tier that reads its keyword
    #: arguments itself.
    settings: Any
    #: ``enable_kv_events`` (default true): the tier reports its stores and evictions
    #: whenever the engine takes events; false keeps it quiet.
    events: bool = True

    @property
    def options(self) -> TierOptions:
        """What the manager takes for this tier."""
        return TierOptions(runner=self.runner, backpressure=self.backpressure)

    def build(self, ctx: TierContext) -> SecondaryTier:
        """The tier, built from :attr:`settings` (see
        :meth:`~kvtier.tiers.factory.SecondaryTierFactory.build_tier`)."""
        return SecondaryTierFactory.build_tier(self.tier_class, ctx, self.settings, self.params)

    @classmethod
    def parse(
        cls,
        raw: Mapping[str, Any],
        index: int,
        *,
        chunk_bytes: int,
        backpressure_defaults: Mapping[str, Any] | None = None,
    ) -> TierConfig:
        """Read one ``secondary_tiers`` entry; tiers with primary rows of ``chunk_bytes``.

        Raises:
            ConfigError: the type cannot be found, or a key is unknown, missing or
                invalid (named by ``secondary_tiers[<index>].<key>``).
        """
        path = tier_path(index)
        tier_class = SecondaryTierFactory.get_tier_class(raw, path)
        params = SecondaryTierFactory.tier_params(raw, tier_class)
        settings = SecondaryTierFactory.parse_params(tier_class, params, path)
        reader = ConfigReader(raw, path)
        locality: Locality = reader.choice("locality", Locality, tier_class.locality)
        name: str | None = reader.string("name", None)
        if name is not None and (":" in name or not name.isprintable()):
            raise ConfigError(f"{path}.name", "expected a printable name without ':'")
        events: bool = reader.boolean("enable_kv_events", True)
        runner = _runner_settings(reader, locality)
        own = reader.mapping("backpressure", None)
        backpressure = None
        if own is not None or backpressure_defaults is not None:
            merged = {**(backpressure_defaults or {}), **(own or {})}
            backpressure = BackpressureSettings.parse(merged, f"{path}.backpressure", locality)
        if settings is not None:
            settings = tier_class.effective_settings(
                settings, chunk_bytes=chunk_bytes, job_timeout_s=runner.job_timeout_s, path=path
            )
        return cls(
            index=index,
            path=path,
            label=f"{index + 1}:{name or raw['type']}",
            type_name=raw["type"],
            tier_class=tier_class,
            locality=locality,
            runner=runner,
            backpressure=backpressure,
            params=MappingProxyType(dict(params)),
            settings=settings,
            events=events,
        )


def _runner_settings(reader: ConfigReader, locality: Locality) -> RunnerSettings:
    default = _RUNNER_DEFAULTS
    return RunnerSettings(
        max_concurrent_jobs=reader.integer(
            "max_concurrent_jobs", default.max_concurrent_jobs, minimum=1
        ),
        max_promotion_chunks=reader.integer(
            "max_promotion_chunks",
            LOCAL_PROMOTION_CHUNKS if locality is Locality.LOCAL else default.max_promotion_chunks,
            minimum=1,
        ),
        job_timeout_s=reader.number(
            "job_timeout_s", default.job_timeout_s, minimum=0, exclusive_minimum=True
        ),
        lookup_timeout_s=reader.number(
            "lookup_timeout_s", default.lookup_timeout_s, minimum=0, exclusive_minimum=True
        ),
        shutdown_grace_s=reader.number("shutdown_grace_s", default.shutdown_grace_s, minimum=0),
    )


@dataclass(frozen=True)
class MetricSettings:
    """What a spec's metric definitions depend on, parsed and checked."""

    #: >= 2: the CPU spec's store gate is on (it counts ``stores_skipped``).
    store_threshold: int = 0
    #: Each secondary tier's class and parsed parameters (``check_params``), in order.
    tiers: tuple[tuple[type[SecondaryTier], Any], ...] = ()

    @classmethod
    def parse(cls, extra_config: Mapping[str, Any]) -> MetricSettings:
        """Read what the metrics depend on from ``extra_config`` alone, with the readers
        :meth:`SpecSettings.parse` uses; other keys are left to the engine's check.

        Raises:
            ConfigError: such a key is invalid, or a tier's type or parameters are.
        """
        reader = ConfigReader(extra_config)
        tiers = []
        for i, raw in enumerate(reader.mapping_list("secondary_tiers", [])):
            tier_class = SecondaryTierFactory.get_tier_class(raw, tier_path(i))
            params = SecondaryTierFactory.tier_params(raw, tier_class)
            tiers.append(
                (tier_class, SecondaryTierFactory.parse_params(tier_class, params, tier_path(i)))
            )
        return cls(
            store_threshold=reader.integer("store_threshold", 0, minimum=0), tiers=tuple(tiers)
        )


@dataclass(frozen=True)
class SpecSettings:
    """A spec's ``extra_config``, parsed and checked, every default filled in."""

    #: The spec that read it (its class name).
    spec_name: str
    #: Bytes of the primary region, all workers together.
    cpu_bytes_to_use: int
    #: Tokens per chunk (``tokens_per_block`` unless given).
    block_size: int
    #: The region's rows: what ``cpu_bytes_to_use`` and ``block_size`` give.
    geometry: ChunkGeometry
    eviction_policy: str
    cache_policy_module_path: str | None
    #: The class ``eviction_policy`` names, resolved (so an unknown one fails at start).
    policy_class: type[CachePolicy]
    #: >= 2: store a chunk only once it was looked up that many times (CPU spec).
    store_threshold: int
    #: Keys whose lookups the store gate counts at most (the least recently looked up
    #: are forgotten first).
    max_tracked_lookups: int
    #: Host hint: offload prompt chunks only, not those produced while decoding.
    offload_prompt_only: bool
    #: Seconds of prefill one chunk costs the host: a secondary hit whose promotion
    #: would take longer is a miss. None: always promote (or the host says it later).
    recompute_s_per_chunk: float | None
    #: Seconds a request's lookups may stay pending; then its pending keys are misses.
    #: None: as long as the tiers take (each job bounded by its ``job_timeout_s``).
    max_pending_s: float | None
    #: The top-level ``backpressure`` mapping as written (checked), read-only: defaults
    #: under each tier's own. None: not given.
    backpressure: Mapping[str, Any] | None
    tiers: tuple[TierConfig, ...]

    @property
    def metrics(self) -> MetricSettings:
        """What the metric definitions depend on, from these records."""
        return MetricSettings(
            store_threshold=self.store_threshold,
            tiers=tuple((tier.tier_class, tier.settings) for tier in self.tiers),
        )

    @classmethod
    def parse(
        cls,
        config: OffloadingConfig,
        *,
        spec_name: str,
        secondary_tiers: bool,
        reader: ConfigReader | None = None,
    ) -> SpecSettings:
        """Read ``config.extra_config`` as the spec ``spec_name`` does.

        ``secondary_tiers`` says whether that spec builds them: one that does not
        refuses the ``secondary_tiers`` and ``backpressure`` keys; one that does
        refuses ``store_threshold`` >= 2 (every stored chunk cascades). ``reader`` is
        a reader over ``config.extra_config`` whose caller reads keys of its own and
        then calls ``reject_unknown``; without one, any key not read here is refused.

        Raises:
            ConfigError: a key is unknown, missing or invalid; the message starts with
                its path (``secondary_tiers[1].root_dir``).
        """
        checked_here = reader is None
        if reader is None:
            reader = ConfigReader(config.extra_config)
        # The factory reads these two to choose the spec; here they are only known.
        reader.raw("spec_name")
        reader.raw("spec_module_path")
        offload_prompt_only: bool = reader.boolean("offload_prompt_only", True)
        block_size: int = reader.integer(
            "block_size", config.tokens_per_block, minimum=config.tokens_per_block
        )
        cpu_bytes_to_use: int = reader.integer("cpu_bytes_to_use", minimum=1)
        eviction_policy: str = reader.string("eviction_policy", DEFAULT_EVICTION_POLICY)
        cache_policy_module_path: str | None = reader.string("cache_policy_module_path", None)
        policy_class = CachePolicyFactory.get_policy_class(
            eviction_policy, cache_policy_module_path
        )
        store_threshold: int = reader.integer("store_threshold", 0, minimum=0)
        max_tracked_lookups: int = reader.integer(
            "max_tracked_lookups", DEFAULT_MAX_TRACKED_LOOKUPS, minimum=1
        )
        recompute_s_per_chunk: float | None = reader.number(
            "recompute_s_per_chunk", None, minimum=0, exclusive_minimum=True
        )
        max_pending_s: float | None = reader.number(
            "max_pending_s", None, minimum=0, exclusive_minimum=True
        )
        geometry = ChunkGeometry.from_config(
            config, cpu_bytes_to_use=cpu_bytes_to_use, block_size=block_size
        )
        if not secondary_tiers:
            for key in ("secondary_tiers", "backpressure"):
                if reader.has(key):
                    raise ConfigError(
                        key,
                        f"{spec_name} has no secondary tiers; set spec_name to "
                        "TieringOffloadingSpec to use them",
                    )
        elif store_threshold >= 2:
            raise ConfigError(
                "store_threshold",
                "is not supported by TieringOffloadingSpec (every stored chunk cascades); "
                "use 0, or CPUOffloadingSpec",
            )
        tier_mappings: list[Mapping[str, Any]] = reader.mapping_list("secondary_tiers", [])
        defaults: Mapping[str, Any] | None = reader.mapping("backpressure", None)
        if defaults is not None:
            # Checked on its own, with or without tiers, so a bad value is named here.
            BackpressureSettings.parse(defaults, "backpressure", Locality.LOCAL, check_marks=False)
            defaults = MappingProxyType(dict(defaults))
        tiers = tuple(
            TierConfig.parse(
                raw, i, chunk_bytes=geometry.chunk_bytes, backpressure_defaults=defaults
            )
            for i, raw in enumerate(tier_mappings)
        )
        if checked_here:
            reader.reject_unknown()
        return cls(
            spec_name=spec_name,
            cpu_bytes_to_use=cpu_bytes_to_use,
            block_size=block_size,
            geometry=geometry,
            eviction_policy=eviction_policy,
            cache_policy_module_path=cache_policy_module_path,
            policy_class=policy_class,
            store_threshold=store_threshold,
            max_tracked_lookups=max_tracked_lookups,
            offload_prompt_only=offload_prompt_only,
            recompute_s_per_chunk=recompute_s_per_chunk,
            max_pending_s=max_pending_s,
            backpressure=defaults,
            tiers=tiers,
        )
