"""The spec interface: config in; manager, worker and metric definitions out."""

from __future__ import annotations

import os
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from prometheus_client import CollectorRegistry

from kvtier.config import ConfigReader, OffloadingConfig
from kvtier.metrics import MetricDefinition
from kvtier.region import DEFAULT_SHM_DIR
from kvtier.resources import AsyncResource
from kvtier.specs.settings import MetricSettings, SpecSettings

if TYPE_CHECKING:
    import torch

    from kvtier.tiering.loop import TierLoop
    from kvtier.tiering.manager import TieringOffloadingManager
    from kvtier.worker.engines import CopyEngine
    from kvtier.worker.layout import PageMap
    from kvtier.worker.worker import OffloadingWorker

__all__ = ["OffloadingSpec"]


class OffloadingSpec(AsyncResource):
    """A way of offloading: reads the config and builds what the host needs.

    The scheduler process calls :meth:`get_manager`; each worker process calls
    :meth:`create_worker` with its KV tensors; ``await`` :meth:`aclose` (or ``close()``,
    or :meth:`shutdown`, for a caller that may block) releases whatever either built.
    Out-of-tree specs subclass this (or a built-in spec) and are selected with
    ``extra_config["spec_name"]`` plus ``extra_config["spec_module_path"]``.

    Every ``extra_config`` key must be read by the spec or listed in
    :attr:`extra_keys`; any other key raises :class:`~kvtier.ConfigError`, so a typo
    never silently falls back to a default.
    """

    #: Further ``extra_config`` keys an out-of-tree subclass accepts without reading.
    extra_keys: ClassVar[frozenset[str]] = frozenset()
    #: Whether this spec builds secondary tiers. One that does not refuses the
    #: ``secondary_tiers`` and ``backpressure`` keys; one that does refuses
    #: ``store_threshold`` >= 2.
    has_secondary_tiers: ClassVar[bool] = False

    def __init__(
        self,
        config: OffloadingConfig,
        *,
        registry: CollectorRegistry | None = None,
        shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR,
    ) -> None:
        self.config = config
        self.registry = registry
        self.shm_dir = shm_dir
        reader = ConfigReader(config.extra_config)
        #: ``extra_config``, parsed once: everything this spec builds comes from it.
        self.settings = SpecSettings.parse(
            config,
            spec_name=type(self).__name__,
            secondary_tiers=self.has_secondary_tiers,
            reader=reader,
        )
        self.read_settings(reader)
        reader.reject_unknown(self.extra_keys)

    def read_settings(self, reader: ConfigReader) -> None:
        """Read an out-of-tree subclass's own ``extra_config`` keys (calling super).

        The built-in keys are in :attr:`settings` already; a key that neither read nor
        :attr:`extra_keys` lists is refused afterwards.
        """

    @property
    def offload_prompt_only(self) -> bool:
        """Host hint: offload prompt chunks only, not those produced while decoding."""
        return self.settings.offload_prompt_only

    @property
    def block_size(self) -> int:
        """Tokens per chunk."""
        return self.settings.block_size

    @classmethod
    def build_metric_definitions(
        cls, extra_config: Mapping[str, Any]
    ) -> dict[str, MetricDefinition]:
        """The metrics this spec's manager exposes, by name, for a caller with
        ``extra_config`` and no engine (vLLM's API server): parsed into
        :class:`~kvtier.specs.settings.MetricSettings`, then as :meth:`metric_definitions`.

        Raises:
            ConfigError: a key the metrics depend on is invalid.
        """
        return cls.metric_definitions(MetricSettings.parse(extra_config))

    @classmethod
    def metric_definitions(cls, settings: MetricSettings) -> dict[str, MetricDefinition]:
        """The metrics this spec's manager exposes for parsed ``settings``, by name.

        A spec built from a configuration uses ``self.settings.metrics``; a subclass
        adds its own to its base's.
        """
        return {}

    @abstractmethod
    def get_manager(self, *, loop: TierLoop | None = None) -> TieringOffloadingManager:
        """The scheduler-side manager (built once, on the first call).

        ``loop`` is where secondary tiers run. None (a synchronous host such as vLLM's
        scheduler): the manager gets a loop thread of its own and comes back started.
        An async host passes ``HostLoop()`` and awaits ``manager.start()``.
        """

    @abstractmethod
    def create_worker(
        self,
        kv_caches: Sequence[torch.Tensor],
        *,
        engine: CopyEngine | None = None,
        groups: Sequence[Sequence[int]] | None = None,
        pages: Sequence[PageMap] | None = None,
    ) -> OffloadingWorker:
        """A worker for rank ``config.rank`` copying between ``kv_caches`` and the region.

        ``groups``: for a model with several KV-cache groups, the indices of the
        ``kv_caches`` each group's layers use (see :class:`OffloadingWorker`).
        ``pages``: with ``config.layout`` canonical, each KV tensor's page map.
        """

    def shutdown(self) -> None:
        """vLLM's name for ``close()``, which vLLM calls on a spec it built, and the same
        call: blocks while copies and tier jobs drain."""
        self.close()

    async def aclose(self) -> None:
        """Release the manager, workers and regions this spec built. Idempotent.

        A spec that builds nothing to release keeps this default. ``close()`` is the
        same for a caller that may block (:mod:`kvtier.resources`).
        """
