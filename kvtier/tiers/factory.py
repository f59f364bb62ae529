"""Finding and building secondary tiers from their configuration."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Mapping
from typing import Any, ClassVar

from kvtier._plugins import Foreign, PluginRegistry
from kvtier.errors import ConfigError
from kvtier.tiers.base import SecondaryTier, TierContext

__all__ = ["SecondaryTierFactory", "framework_keys", "takes_settings"]

#: Keys of a tier's mapping that select and label it and set its framework options
#: other than how its jobs run.
_OWN_KEYS = ("type", "module_path", "name", "backpressure", "locality", "enable_kv_events")


@functools.cache
def framework_keys() -> frozenset[str]:
    """Keys of a tier's configuration that the framework reads; the rest go to the tier.

    How the tier is found and labelled, its ``locality``, ``backpressure`` and
    ``enable_kv_events``, and a key per field of
    :class:`~kvtier.tiering.runner.RunnerSettings`, the record of how its jobs run: a
    field added there is a framework key at once.
    """
    # Imported on the first call: the tiering engine imports this package as it loads.
    from kvtier.tiering.runner import RunnerSettings

    runner = (field.name for field in dataclasses.fields(RunnerSettings))
    return frozenset((*_OWN_KEYS, *runner))


#: Where vLLM 0.33 defines its tier interface, ``SecondaryTierManager``.
_VLLM_TIER_BASE = ("vllm.v1.kv_offload.tiering.base", "SecondaryTierManager")


def _adapt_vllm_tier(target: object) -> type[SecondaryTier] | None:
    """The adapter for a vLLM ``SecondaryTierManager`` subclass; None for anything else.

    Recognised by its bases' names, so that nothing here imports vLLM: such a class
    exists only where vLLM is imported already.
    """
    if not isinstance(target, type):
        return None
    if not any((base.__module__, base.__qualname__) == _VLLM_TIER_BASE for base in target.__mro__):
        return None
    from kvtier.integrations.vllm_plugin import adapter_for

    return adapter_for(target)


def _find_vllm_tier(name: str) -> object | None:
    """The class vLLM's own ``SecondaryTierFactory`` has registered as ``name``; None
    where it has none, or where vLLM is not loaded (then nobody registered one)."""
    if "vllm" not in sys.modules:
        return None
    from kvtier.integrations.vllm_plugin import registered_tier

    return registered_tier(name)


class SecondaryTierFactory:
    """Tier types by name: built-in (one registry line each below), registered, or
    imported.

    A tier configuration's ``type`` is a registered name, or the name of a
    :class:`SecondaryTier` subclass to import from its ``module_path``. A tier written
    for vLLM 0.33 (a ``SecondaryTierManager`` subclass, named the same way or
    registered with vLLM's own ``SecondaryTierFactory``) is run through
    :class:`~kvtier.integrations.vllm_plugin.VllmPluginTier`.
    """

    _registry: ClassVar[PluginRegistry[SecondaryTier]] = PluginRegistry(
        SecondaryTier,  # type: ignore[type-abstract]
        "tier type",
        "type",
        "module_path",
        Foreign("a vLLM SecondaryTierManager", _adapt_vllm_tier, _find_vllm_tier),
    )
    _registry.register("example", "kvtier.tiers.example", "ExampleTier")
    _registry.register("fs", "kvtier.tiers.fs", "FileSystemTier")
    _registry.register("s3", "kvtier.tiers.s3.tier", "S3Tier")
    _registry.register("obj", "kvtier.tiers.s3.tier", "S3Tier")
    _registry.register("p2p", "kvtier.tiers.p2p", "PeerTier")
    _registry.register("memcached", "kvtier.tiers.memcached", "MemcachedTier")
    _registry.register("redis", "kvtier.tiers.redis", "RedisTier")
    _registry.register("mooncake", "kvtier.tiers.mooncake", "MooncakeTier")

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
    def tier_params(
        cls, tier_config: Mapping[str, Any], tier_class: type[SecondaryTier] | None = None
    ) -> dict[str, Any]:
        """The keys of a tier configuration that are the tier's own parameters, with the
        framework's keys ``tier_class`` shares (:attr:`SecondaryTier.shared_keys`)."""
        framework = framework_keys().difference(tier_class.shared_keys if tier_class else ())
        return {k: v for k, v in tier_config.items() if k not in framework}

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
        cls.parse_params(tier_class, cls.tier_params(tier_config, tier_class), config_path)
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
        """Build the tier ``tier_config`` describes, its parameters parsed and derived
        for ``ctx`` as an engine does (:meth:`SecondaryTier.settings_for`).

        Raises:
            ConfigError: as :meth:`check_tier`, or a parameter that does not fit the
                engine (``ctx.chunk_bytes``, ``ctx.job_timeout_s``).
        """
        tier_class = cls.get_tier_class(tier_config, ctx.config_path)
        params = cls.tier_params(tier_config, tier_class)
        _check_signature(tier_class, params, ctx.config_path)
        return cls.build_tier(tier_class, ctx, tier_class.settings_for(ctx, params), params)

    @classmethod
    def build_tier(
        cls,
        tier_class: type[SecondaryTier],
        ctx: TierContext,
        settings: Any,
        params: Mapping[str, Any],
    ) -> SecondaryTier:
        """Build a tier from its checked configuration: its effective ``settings``
        record (``tier_class(ctx, settings)``) when its ``__init__`` takes one, else
        its ``params`` as keyword arguments (``tier_class(ctx, **params)``)."""
        if settings is not None and takes_settings(tier_class):
            return tier_class(ctx, settings)  # type: ignore[call-arg]
        return tier_class(ctx, **params)


def takes_settings(tier_class: type[SecondaryTier]) -> bool:
    """Whether ``tier_class`` is built from its settings record: its ``__init__``
    names a ``settings`` parameter after ``ctx``."""
    return "settings" in list(inspect.signature(tier_class.__init__).parameters)[2:]


def _check_signature(tier_class: type[SecondaryTier], params: Mapping[str, Any], path: str) -> None:
    """Name unknown or missing parameters of tiers that declare them as keywords."""
    if tier_class.settings_class is not None and takes_settings(tier_class):
        return  # its settings class names them
    signature = inspect.signature(tier_class.__init__)
    accepted = list(signature.parameters.values())[2:]  # self, ctx
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted):
        return  # the tier reads **params itself and names its own errors
    names = {p.name for p in accepted}
    for key in params:
        if key not in names:
            known = ", ".join(sorted(names | framework_keys()))
            raise ConfigError(
                f"{path}.{key}", f"unknown parameter of {tier_class.__name__} (known: {known})"
            )
    for p in accepted:
        if p.default is inspect.Parameter.empty and p.name not in params:
            raise ConfigError(f"{path}.{p.name}", "is required")
