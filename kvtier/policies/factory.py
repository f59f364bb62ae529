"""Finding an eviction policy by name."""

from __future__ import annotations

from typing import ClassVar

from kvtier._plugins import PluginRegistry
from kvtier.policies.base import CachePolicy

__all__ = ["CachePolicyFactory"]


class CachePolicyFactory:
    """Names of eviction policies, built in and registered.

    ``eviction_policy`` names a registered policy (``lru`` and ``arc`` are built in),
    or, together with ``cache_policy_module_path``, a :class:`CachePolicy` subclass to
    import from that module.
    """

    _registry: ClassVar[PluginRegistry[CachePolicy]] = PluginRegistry(
        CachePolicy,  # type: ignore[type-abstract]
        "eviction policy",
        "eviction_policy",
        "cache_policy_module_path",
    )
    _registry.register("lru", "kvtier.policies.lru", "LRUCachePolicy")
    _registry.register("arc", "kvtier.policies.arc", "ARCCachePolicy")

    @classmethod
    def register_policy(
        cls, name: str, policy: type[CachePolicy] | str, class_name: str | None = None
    ) -> None:
        """Make ``name`` select a policy: the class itself, or a module path and class name.

        Raises:
            ValueError: ``name`` is taken or the arguments do not name a class.
        """
        cls._registry.register(name, policy, class_name)

    @classmethod
    def names(cls) -> list[str]:
        return cls._registry.names()

    @classmethod
    def get_policy_class(cls, name: str, module_path: str | None = None) -> type[CachePolicy]:
        """The class ``name`` selects.

        Raises:
            ConfigError: unknown name, a module that does not import, or a class that
                is not a :class:`CachePolicy`.
        """
        return cls._registry.resolve(name, module_path)

    @classmethod
    def create(cls, name: str, capacity: int, module_path: str | None = None) -> CachePolicy:
        return cls.get_policy_class(name, module_path)(capacity)
