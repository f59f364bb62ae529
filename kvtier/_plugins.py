"""Named plug-in classes: built-in names, registered names and out-of-tree imports.

Eviction policies, specs and secondary tiers are all chosen the same way: a name that
is registered (lazily, as ``module:Class``, so built-ins cost nothing until used), or a
class name together with a module path to import it from. A registry may also take
classes written against another framework's interface (:class:`Foreign`): it hands
back an adapter that is a subclass of its base.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvtier.errors import ConfigError

__all__ = ["Foreign", "PluginRegistry"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class Foreign(Generic[_T]):
    """Classes of another framework's interface that a registry accepts, adapted.

    Consulted only where the registry itself has no answer: a name it does not know,
    or a class that is not a subclass of its base.
    """

    #: What such a class is, for messages ("a vLLM SecondaryTierManager").
    what: str
    #: The adapter (a subclass of the registry's base) for a class of that interface;
    #: None for any other object.
    adapt: Callable[[object], type[_T] | None]
    #: The class another framework's own registry knows by a name; None if it does not.
    find: Callable[[str], object | None]


class PluginRegistry(Generic[_T]):
    """Names -> subclasses of ``base``; errors name the configuration keys involved."""

    def __init__(
        self,
        base: type[_T],
        what: str,
        name_key: str,
        module_key: str,
        foreign: Foreign[_T] | None = None,
    ) -> None:
        self._base = base
        self._foreign = foreign
        self._what = what
        self._name_key = name_key
        self._module_key = module_key
        self._entries: dict[str, type[_T] | tuple[str, str]] = {}

    def names(self) -> list[str]:
        return sorted(self._entries)

    def register(self, name: str, target: type[_T] | str, class_name: str | None = None) -> None:
        """Register a class, or a module path and class name to import on first use.

        Raises:
            ValueError: the name is taken or the arguments do not name a class.
        """
        if not name:
            raise ValueError(f"a {self._what} needs a non-empty name")
        if name in self._entries:
            raise ValueError(f"a {self._what} named {name!r} is already registered")
        if isinstance(target, str):
            if not class_name:
                raise ValueError(f"registering a {self._what} by module path needs class_name")
            self._entries[name] = (target, class_name)
        else:
            self._check(target, self._name_key)
            self._entries[name] = target

    def resolve(self, name: str, module_path: str | None = None) -> type[_T]:
        """The class for ``name``: imported from ``module_path`` if given, else registered.

        Raises:
            ConfigError: unknown name, a module that does not import, a missing class,
                or a class that is not a subclass of the expected base.
        """
        if module_path:
            return self._import(module_path, name, self._module_key)
        entry = self._entries.get(name)
        if entry is None and self._foreign is not None:
            found = self._foreign.find(name)
            if found is not None:
                return self._check(found, self._name_key)
        if entry is None:
            raise ConfigError(
                self._name_key,
                f"unknown {self._what} {name!r}; expected one of {', '.join(self.names())}, "
                f"or a class name together with {self._module_key}",
            )
        if isinstance(entry, tuple):
            entry = self._import(entry[0], entry[1], self._name_key)
            self._entries[name] = entry
        return entry

    def _import(self, module_path: str, class_name: str, key: str) -> type[_T]:
        try:
            module = importlib.import_module(module_path)
        except ImportError as exc:
            raise ConfigError(key, f"cannot import module {module_path!r}: {exc}") from exc
        target = getattr(module, class_name, None)
        if target is None:
            raise ConfigError(
                self._name_key, f"module {module_path!r} has no class named {class_name!r}"
            )
        return self._check(target, self._name_key)

    def _check(self, target: object, key: str) -> type[_T]:
        if isinstance(target, type) and issubclass(target, self._base):
            return target
        expected = f"a subclass of kvtier.{self._base.__name__}"
        if self._foreign is not None:
            adapter = self._foreign.adapt(target)
            if adapter is not None:
                return adapter
            expected += f" or {self._foreign.what}"
        raise ConfigError(key, f"{target!r} is not {expected}")
