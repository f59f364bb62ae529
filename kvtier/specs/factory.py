"""Choosing a spec from ``extra_config``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from kvtier._plugins import PluginRegistry
from kvtier.config import ConfigReader, OffloadingConfig
from kvtier.specs.base import OffloadingSpec

__all__ = ["OffloadingSpecFactory", "spec_name_for", "with_spec_name"]


def spec_name_for(extra_config: Mapping[str, Any]) -> str:
    """The built-in spec ``extra_config`` needs: the tiering spec when it has the keys
    the CPU spec refuses (``secondary_tiers``, even empty, or ``backpressure``), else
    the CPU spec."""
    if "secondary_tiers" in extra_config or "backpressure" in extra_config:
        return "TieringOffloadingSpec"
    return "CPUOffloadingSpec"


def with_spec_name(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``extra_config`` that names its spec: its own ``spec_name``, else the
    one :func:`spec_name_for` picks.

    For readers of a bare ``extra_config`` file (``kvtier plan``, ``kvtier bench
    --config``), which must read a file with ``secondary_tiers`` and no ``spec_name``
    the same way. The library's own default stays ``CPUOffloadingSpec``.
    """
    named = dict(extra_config)
    named.setdefault("spec_name", spec_name_for(named))
    return named


class OffloadingSpecFactory:
    """Builds the spec ``extra_config["spec_name"]`` names (default ``CPUOffloadingSpec``).

    With ``extra_config["spec_module_path"]`` the name is a class imported from that
    module; it must subclass :class:`OffloadingSpec`.
    """

    _registry: ClassVar[PluginRegistry[OffloadingSpec]] = PluginRegistry(
        OffloadingSpec,  # type: ignore[type-abstract]
        "spec",
        "spec_name",
        "spec_module_path",
    )
    _registry.register("CPUOffloadingSpec", "kvtier.specs.cpu", "CPUOffloadingSpec")
    _registry.register("TieringOffloadingSpec", "kvtier.specs.tiering", "TieringOffloadingSpec")

    @classmethod
    def register_spec(
        cls, name: str, spec: type[OffloadingSpec] | str, class_name: str | None = None
    ) -> None:
        """Make ``spec_name=name`` select a spec: the class, or a module path and class name."""
        cls._registry.register(name, spec, class_name)

    @classmethod
    def names(cls) -> list[str]:
        return cls._registry.names()

    @classmethod
    def get_spec_class(cls, config: OffloadingConfig) -> type[OffloadingSpec]:
        """The spec class ``config.extra_config`` selects.

        Raises:
            ConfigError: unknown ``spec_name``, an import failure, or not a spec class.
        """
        reader = ConfigReader(config.extra_config)
        name = reader.string("spec_name", "CPUOffloadingSpec")
        module_path = reader.string("spec_module_path", None)
        return cls._registry.resolve(name, module_path)

    @classmethod
    def create_spec(cls, config: OffloadingConfig, **kwargs: Any) -> OffloadingSpec:
        """Build the selected spec; ``kwargs`` (``registry``, ``shm_dir``) pass through."""
        return cls.get_spec_class(config)(config, **kwargs)
