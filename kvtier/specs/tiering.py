"""The primary tier plus an ordered list of secondary tiers."""

from __future__ import annotations

import contextlib
import logging

from kvtier.config import storage_namespace
from kvtier.metrics import MetricDefinition, MetricsRecorder, tiering_metric_definitions
from kvtier.region import SharedOffloadRegion
from kvtier.specs.cpu import CPUOffloadingSpec
from kvtier.specs.settings import MetricSettings, TierConfig
from kvtier.tiering.loop import LoopThread, TierLoop
from kvtier.tiering.manager import TieringOffloadingManager
from kvtier.tiers.base import PrimaryAccess, TierContext

__all__ = ["TieringOffloadingSpec"]

logger = logging.getLogger(__name__)


class TieringOffloadingSpec(CPUOffloadingSpec):
    """The CPU primary tier with ``secondary_tiers`` behind it.

    Each entry of ``secondary_tiers`` is a mapping with a ``type`` (``example``,
    ``fs``, a registered name, or a class name with ``module_path``), the tier's own
    parameters, and optionally the framework's keys (``name``, ``locality``,
    ``backpressure``, ``enable_kv_events`` and those of
    :class:`~kvtier.tiering.runner.RunnerSettings`); a top-level ``backpressure``
    mapping supplies defaults, merged field by field under each tier's own.
    :attr:`settings` holds them parsed, one :class:`~kvtier.specs.settings.TierConfig`
    per tier.
    """

    has_secondary_tiers = True
    #: The host's own spec for this engine, handed to every tier as
    #: ``TierContext.host_spec`` (set by the vLLM adapter to vLLM's spec).
    host_spec: object | None = None

    @property
    def namespace(self) -> str:
        """The identity of this engine's chunk bytes (see ``storage_namespace``)."""
        return storage_namespace(self.config, self.geometry)

    @classmethod
    def metric_definitions(cls, settings: MetricSettings) -> dict[str, MetricDefinition]:
        definitions = super().metric_definitions(settings)
        definitions.update(tiering_metric_definitions())
        for tier_class, tier_settings in settings.tiers:
            definitions.update(tier_class.build_metric_definitions(tier_settings))
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
            start_here = loop is None and bool(self.settings.tiers)
            if start_here:
                loop = LoopThread()
                building.callback(loop.close)
            metrics = self.new_metrics()
            # Each tier is built from the settings record parsed (and derived for this
            # engine) when the spec was: nothing is read twice.
            tiers = [
                tier.build(self._tier_context(tier, region, metrics))
                for tier in self.settings.tiers
            ]
            manager = TieringOffloadingManager(
                self.new_primary(),
                tiers=tiers,
                tier_options=[tier.options for tier in self.settings.tiers],
                region=region,
                metrics=metrics,
                loop=loop,
                recompute_s_per_chunk=self.settings.recompute_s_per_chunk,
                max_pending_s=self.settings.max_pending_s,
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

    def _tier_context(
        self, tier: TierConfig, region: SharedOffloadRegion, metrics: MetricsRecorder
    ) -> TierContext:
        return TierContext(
            primary_view=region.primary_view,
            chunk_bytes=self.chunk_bytes,
            namespace=self.namespace,
            tier_name=tier.label,
            config_path=tier.path,
            model_name=self.config.model_name,
            metrics=metrics,
            primary=PrimaryAccess(region.primary_view),
            enable_events=self.config.enable_kv_events and tier.events,
            job_timeout_s=tier.runner.job_timeout_s,
            tier_type=tier.type_name,
            host_spec=self.host_spec,
        )
