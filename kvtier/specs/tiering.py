"""The primary tier plus an ordered list of secondary tiers."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from kvtier.config import ConfigReader, storage_namespace
from kvtier.errors import ConfigError
from kvtier.metrics import MetricDefinition, MetricsRecorder, tiering_metric_definitions
from kvtier.region import SharedOffloadRegion
from kvtier.specs.cpu import CPUOffloadingSpec
from kvtier.tiering.backpressure import DEFAULT_MARKS, BackpressureSettings
from kvtier.tiering.loop import LoopThread, TierLoop
from kvtier.tiering.manager import TieringOffloadingManager, TierOptions
from kvtier.tiering.runner import RunnerSettings
from kvtier.tiers.base import PrimaryAccess, SecondaryTier, TierContext
from kvtier.tiers.factory import SecondaryTierFactory
from kvtier.tiers.fs import DEFAULT_READ_DEPTH

__all__ = ["TieringOffloadingSpec"]

logger = logging.getLogger(__name__)

# Chunks a local tier (fs) promotes at once before further promotion jobs wait: twice
# the fs tier's default read depth. A job is striped over all of the tier's read
# threads, so one 16-chunk job keeps the disk as busy as several, and jobs that share
# the disk all finish late (benchmarks/serving_path.py: at 1 GiB, one job at a time
# read at 1.07 of raw with job times p50 43 ms, two at a time at 0.85 with p50 85 ms);
# short jobs still run several at once. Remote tiers wait on round trips rather than a
# device: they run as many jobs as max_concurrent_jobs allows.
LOCAL_PROMOTION_CHUNKS = 2 * DEFAULT_READ_DEPTH


class TieringOffloadingSpec(CPUOffloadingSpec):
    """The CPU primary tier with ``secondary_tiers`` behind it.

    Each entry of ``secondary_tiers`` is a mapping with a ``type`` (``example``,
    ``fs``, a registered name, or a class name with ``module_path``), the tier's own
    parameters, and optionally the framework's keys: ``name`` (label suffix),
    ``backpressure``, ``locality`` (``local``/``remote``), ``max_concurrent_jobs``,
    ``max_promotion_chunks``, ``job_timeout_s``, ``lookup_timeout_s`` and
    ``shutdown_grace_s``. A top-level
    ``backpressure`` mapping supplies defaults, merged field by field under each
    tier's own.
    """

    def read_settings(self, reader: ConfigReader) -> None:
        super().read_settings(reader)
        if self.store_threshold >= 2:
            raise ConfigError(
                "store_threshold",
                "is not supported by TieringOffloadingSpec (every stored chunk cascades); "
                "use 0, or CPUOffloadingSpec",
            )
        self.tier_configs: list[Mapping[str, Any]] = reader.mapping_list("secondary_tiers", [])
        default_backpressure = reader.mapping("backpressure", None)
        if default_backpressure is not None:
            # Checked on its own, with or without tiers, so a bad value is named here.
            BackpressureSettings.parse(
                default_backpressure, "backpressure", "local", check_marks=False
            )
        self.tier_classes: list[type[SecondaryTier]] = []
        self.tier_options: list[TierOptions] = []
        for i, tier_config in enumerate(self.tier_configs):
            path = self.tier_config_path(i)
            tier_class = SecondaryTierFactory.check_tier(tier_config, path)
            self.tier_classes.append(tier_class)
            self.tier_options.append(
                _tier_options(tier_config, tier_class, default_backpressure, path)
            )
        self.namespace = storage_namespace(self.config, self.geometry)

    def _check_no_tiers(self, reader: ConfigReader) -> None:
        return  # this spec is the one that has them

    @classmethod
    def build_metric_definitions(
        cls, extra_config: Mapping[str, Any]
    ) -> dict[str, MetricDefinition]:
        definitions = super().build_metric_definitions(extra_config)
        definitions.update(tiering_metric_definitions())
        tiers = extra_config.get("secondary_tiers", [])
        if not isinstance(tiers, list):
            raise ConfigError("secondary_tiers", "expected a list of tier mappings")
        for i, tier_config in enumerate(tiers):
            tier_class = SecondaryTierFactory.get_tier_class(tier_config, cls.tier_config_path(i))
            definitions.update(tier_class.build_metric_definitions(tier_config))
        return definitions

    def get_manager(self, *, loop: TierLoop | None = None) -> TieringOffloadingManager:
        """Build the region, primary tier, tiers and manager.

        With ``loop`` None (a synchronous host) the tiers get a loop thread of the
        manager's own and the manager comes back started. An async host passes
        ``HostLoop()`` and awaits ``manager.start()``. If any step fails, everything
        built so far is closed (region and loop thread included) and the error
        propagates.
        """
        if self._manager is not None:
            return self._manager
        with contextlib.ExitStack() as building:
            region = building.enter_context(self.open_region(None))
            start_here = loop is None and bool(self.tier_configs)
            if start_here:
                loop = LoopThread()
                building.callback(loop.close)
            metrics = self.new_metrics()
            tiers = [
                SecondaryTierFactory.create_tier(
                    tier_config, self._tier_context(i, region, metrics)
                )
                for i, tier_config in enumerate(self.tier_configs)
            ]
            manager = TieringOffloadingManager(
                self.new_primary(),
                tiers=tiers,
                tier_options=self.tier_options,
                region=region,
                metrics=metrics,
                loop=loop,
            )
            building.pop_all()  # the manager owns the region and the loop now
        if start_here:
            try:
                manager.start_blocking()
            except BaseException:
                manager.close()
                raise
        logger.info(
            "tiering: %d primary chunks of %d bytes, tiers %s",
            self.num_chunks,
            self.chunk_bytes,
            ", ".join(manager.diagnostics.tier_labels) or "none",
        )
        self._manager = manager
        return manager

    def tier_label(self, index: int) -> str:
        """The label of tier ``index`` in metrics, logs and events: ``1:fs``, ``2:s3``..."""
        tier_config = self.tier_configs[index]
        return f"{index + 1}:{tier_config.get('name') or tier_config['type']}"

    @staticmethod
    def tier_config_path(index: int) -> str:
        """Where tier ``index``'s settings sit in extra_config, for error messages."""
        return f"secondary_tiers[{index}]"

    def _tier_context(
        self, index: int, region: SharedOffloadRegion, metrics: MetricsRecorder
    ) -> TierContext:
        return TierContext(
            primary_view=region.primary_view,
            chunk_bytes=self.chunk_bytes,
            namespace=self.namespace,
            tier_name=self.tier_label(index),
            config_path=self.tier_config_path(index),
            model_name=self.config.model_name,
            metrics=metrics,
            primary=PrimaryAccess(region.primary_view),
            enable_events=self.config.enable_kv_events,
            job_timeout_s=self.tier_options[index].runner.job_timeout_s,
        )


def _tier_options(
    tier_config: Mapping[str, Any],
    tier_class: type[SecondaryTier],
    default_backpressure: Mapping[str, Any] | None,
    path: str,
) -> TierOptions:
    reader = ConfigReader(tier_config, path)
    locality = reader.string("locality", tier_class.locality, choices=tuple(DEFAULT_MARKS))
    name = reader.string("name", None)
    if name is not None and (":" in name or not name.isprintable()):
        raise ConfigError(f"{path}.name", "expected a printable name without ':'")
    max_jobs = reader.integer("max_concurrent_jobs", 8, minimum=1)
    runner = RunnerSettings(
        max_concurrent_jobs=max_jobs,
        max_promotion_chunks=reader.integer(
            "max_promotion_chunks",
            LOCAL_PROMOTION_CHUNKS if locality == "local" else None,
            minimum=1,
        ),
        job_timeout_s=reader.number("job_timeout_s", 30.0, minimum=0, exclusive_minimum=True),
        lookup_timeout_s=reader.number("lookup_timeout_s", 5.0, minimum=0, exclusive_minimum=True),
        shutdown_grace_s=reader.number("shutdown_grace_s", 5.0, minimum=0),
    )
    own = reader.mapping("backpressure", None)
    backpressure = None
    if own is not None or default_backpressure is not None:
        merged = {**(default_backpressure or {}), **(own or {})}
        backpressure = BackpressureSettings.parse(merged, f"{path}.backpressure", locality)
    return TierOptions(runner=runner, backpressure=backpressure)
