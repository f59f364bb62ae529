"""Offloading to CPU memory only: the primary tier on its shared region."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvtier.config import ChunkGeometry, OffloadingConfig
from kvtier.metrics import MetricDefinition, MetricsRecorder, cpu_metric_definitions
from kvtier.primary import PrimaryTier
from kvtier.region import SharedOffloadRegion
from kvtier.resources import Resource, aclose_all
from kvtier.specs.base import OffloadingSpec
from kvtier.specs.settings import MetricSettings
from kvtier.tiering.manager import TieringOffloadingManager

if TYPE_CHECKING:
    import torch

    from kvtier.tiering.loop import TierLoop
    from kvtier.worker.engines import CopyEngine
    from kvtier.worker.layout import PageMap
    from kvtier.worker.worker import OffloadingWorker

__all__ = ["CPUOffloadingSpec"]

logger = logging.getLogger(__name__)


class CPUOffloadingSpec(OffloadingSpec):
    """The primary tier alone: ``cpu_bytes_to_use`` of shared CPU memory.

    Uses ``cpu_bytes_to_use`` (required), ``eviction_policy`` and
    ``cache_policy_module_path``, and ``store_threshold`` (>= 2: store a chunk only
    once it was looked up that many times; ``max_tracked_lookups`` keys counted at
    most), from :attr:`settings`.
    """

    def __init__(self, config: OffloadingConfig, **kwargs: Any) -> None:
        self._manager: TieringOffloadingManager | None = None
        self._workers: list[OffloadingWorker] = []
        super().__init__(config, **kwargs)

    @classmethod
    def metric_definitions(cls, settings: MetricSettings) -> dict[str, MetricDefinition]:
        definitions = super().metric_definitions(settings)
        definitions.update(cpu_metric_definitions(settings.store_threshold))
        return definitions

    @property
    def geometry(self) -> ChunkGeometry:
        return self.settings.geometry

    @property
    def blocks_per_chunk(self) -> int:
        return self.geometry.blocks_per_chunk

    @property
    def num_chunks(self) -> int:
        return self.geometry.num_chunks

    @property
    def chunk_bytes(self) -> int:
        return self.geometry.chunk_bytes

    def open_region(self, rank: int | None) -> SharedOffloadRegion:
        """Open this engine's region from the scheduler side (None) or a worker rank."""
        return SharedOffloadRegion.for_geometry(
            self.config.engine_id, self.geometry, rank, shm_dir=self.shm_dir
        )

    def new_metrics(self) -> MetricsRecorder:
        """The recorder of this spec's metrics, defined from :attr:`settings`."""
        return MetricsRecorder(self.metric_definitions(self.settings.metrics), self.registry)

    def new_primary(self) -> PrimaryTier:
        return PrimaryTier(
            self.num_chunks,
            self.settings.policy_class(self.num_chunks),
            enable_events=self.config.enable_kv_events,
        )

    def get_manager(self, *, loop: TierLoop | None = None) -> TieringOffloadingManager:
        """The manager of the primary tier alone (it needs no loop; ``loop`` is unused)."""
        if self._manager is None:
            with contextlib.ExitStack() as building:
                region = building.enter_context(self.open_region(None))
                self._manager = TieringOffloadingManager(
                    self.new_primary(),
                    region=region,
                    metrics=self.new_metrics(),
                    store_threshold=self.settings.store_threshold,
                    max_tracked_lookups=self.settings.max_tracked_lookups,
                )
                building.pop_all()  # the manager owns the region now
            logger.info(
                "primary tier: %d chunks of %d bytes (%s eviction)",
                self.num_chunks,
                self.chunk_bytes,
                self.settings.eviction_policy,
            )
        return self._manager

    def create_worker(
        self,
        kv_caches: Sequence[torch.Tensor],
        *,
        engine: CopyEngine | None = None,
        groups: Sequence[Sequence[int]] | None = None,
        pages: Sequence[PageMap] | None = None,
    ) -> OffloadingWorker:
        """This rank's worker over ``kv_caches`` (see
        :class:`~kvtier.worker.worker.OffloadingWorker`).

        Raises:
            ValueError: the tensors do not fit the region's column; ``pages`` is given
                without the canonical layout, or missing with it.
        """
        # Imported here, with torch: a spec read to check or plan a configuration
        # (``kvtier plan``) builds no worker and needs no tensor.
        from kvtier.worker.worker import OffloadingWorker

        layout = self.config.layout
        if (pages is not None) != (layout == "canonical"):
            raise ValueError(
                "a canonical layout's worker needs a page map per KV tensor (pages=), "
                f"and only its worker takes one; this engine's layout is {layout!r}"
            )
        with contextlib.ExitStack() as building:
            region = building.enter_context(self.open_region(self.config.rank))
            worker = OffloadingWorker(
                region,
                kv_caches,
                self.blocks_per_chunk,
                engine=engine,
                groups=groups,
                pages=pages,
                # One rank writes a direct layout's single copy; a canonical layout's
                # page maps deal its pages out among the ranks.
                stores=not self.config.replicated or layout == "canonical" or self.config.rank == 0,
            )
            building.pop_all()  # the worker owns its region now
        self._workers.append(worker)
        return worker

    async def aclose(self) -> None:
        # The reverse of building: the workers, the last built first, then the manager.
        # Each closes however the others went.
        parts: list[Resource] = list(reversed(self._workers))
        if self._manager is not None:
            parts.append(self._manager)
        await aclose_all(type(self).__name__, parts)
        self._workers.clear()
