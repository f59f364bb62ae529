"""Finding and building secondary tiers from their configuration."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

from kvtier._plugins import PluginRegistry
from kvtier.errors import ConfigError
from kvtier.tiers.base import SecondaryTier, TierContext

__all__ = ["FRAMEWORK_KEYS", "SecondaryTierFactory"]

#: Keys of a tier's configuration that the framework reads; the rest go to the tier.
FRAMEWORK_KEYS = frozenset(
    {
        "type",
        "module_path",
        "name",
        "backpressure",
        "locality",
        "max_concurrent_jobs",
        "max_promotion_chunks",
        "job_timeout_s",
        "lookup_timeout_s",
        "shutdown_grace_s",
    }
)


class SecondaryTierFactory:
    """Tier types by name: built-in (``example``, ``fs``, ``s3``/``obj``, ``p2p``),
    registered, or imported.

    A tier configuration's ``type`` is a registered name, or the name of a
    :class:`SecondaryTier` subclass to import from its ``module_path``.
    """

    _registry: ClassVar[PluginRegistry[SecondaryTier]] = PluginRegistry(
        SecondaryTier,  # type: ignore[type-abstract]
        "tier type",
        "type",
        "module_path",
    )
    _registry.register("example", "kvtier.tiers.example", "ExampleTier")
    _registry.register("fs", "kvtier.tiers.fs", "FileSystemTier")
    _registry.register("s3", "kvtier.tiers.s3.tier", "S3Tier")
    _registry.register("obj", "kvtier.tiers.s3.tier", "S3Tier")
    _registry.register("p2p", "kvtier.tiers.p2p", "PeerTier")

    @classmethod
    def register_tier(
        cls, name: str, module_path: str | type[SecondaryTier], class_name: str | None = None
    ) -> None:
        """Make ``type: name`` select a tier: a module path and class name, or the class."""
        cls._registry.register(name, module_path, class_name)

    @classmethod
    def names(cls) -> list[str]:
        return cls._registry.names()

    @classmethod
    def get_tier_class(
        cls, tier_config: Mapping[str, Any], config_path: str = "secondary_tiers[0]"
    ) -> type[SecondaryTier]:
        """The class a tier configuration selects.

        Raises:
            ConfigError: no ``type``, an unknown one, or a class that is not a tier.
        """
        if not isinstance(tier_config, Mapping):
            raise ConfigError(config_path, "expected a mapping with a 'type'")
        name = tier_config.get("type")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{config_path}.type", "is required (a tier type name)")
        module_path = tier_config.get("module_path")
        try:
            return cls._registry.resolve(name, module_path)
        except ConfigError as exc:
            raise ConfigError(f"{config_path}.{exc.path}", exc.problem) from None

    @classmethod
    def tier_params(cls, tier_config: Mapping[str, Any]) -> dict[str, Any]:
        """The keys of a tier configuration that are the tier's own parameters."""
        return {k: v for k, v in tier_config.items() if k not in FRAMEWORK_KEYS}

    @classmethod
    def check_tier(
        cls, tier_config: Mapping[str, Any], config_path: str = "secondary_tiers[0]"
    ) -> type[SecondaryTier]:
        """The class a tier configuration selects, its parameters checked; builds nothing.

        Raises:
            ConfigError: the type cannot be found, or a parameter is unknown, missing or
                invalid (the message names ``<config_path>.<parameter>``).
        """
        tier_class = cls.get_tier_class(tier_config, config_path)
        cls.parse_params(tier_class, cls.tier_params(tier_config), config_path)
        return tier_class

    @classmethod
    def parse_params(
        cls, tier_class: type[SecondaryTier], params: Mapping[str, Any], config_path: str
    ) -> Any:
        """The tier's own parameters checked, and parsed by its ``settings_class``.

        Returns None for a tier without a ``settings_class`` (it reads its keyword
        arguments itself); builds nothing.

        Raises:
            ConfigError: a parameter is unknown, missing or invalid (the message names
                ``<config_path>.<parameter>``).
        """
        _check_signature(tier_class, params, config_path)
        return tier_class.check_params(params, config_path)

    @classmethod
    def create_tier(cls, tier_config: Mapping[str, Any], ctx: TierContext) -> SecondaryTier:
        """Build the tier ``tier_config`` describes (checked as :meth:`check_tier` does)."""
        tier_class = cls.check_tier(tier_config, ctx.config_path)
        return tier_class(ctx, **cls.tier_params(tier_config))


def _check_signature(tier_class: type[SecondaryTier], params: Mapping[str, Any], path: str) -> None:
    """Name unknown or missing parameters of tiers that declare them as keywords."""
    signature = inspect.signature(tier_class.__init__)
    accepted = list(signature.parameters.values())[2:]  # self, ctx
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted):
        return  # the tier reads **params itself and names its own errors
    names = {p.name for p in accepted}
    for key in params:
        if key not in names:
            known = ", ".join(sorted(names | FRAMEWORK_KEYS))
            raise ConfigError(
                f"{path}.{key}", f"unknown parameter of {tier_class.__name__} (known: {known})"
            )
    for p in accepted:
        if p.default is inspect.Parameter.empty and p.name not in params:
            raise ConfigError(f"{path}.{p.name}", "is required")
