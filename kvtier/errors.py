"""The exceptions kvtier raises.

Everything kvtier raises on purpose derives from :class:`KVTierError`, so a host can
catch the whole family in one place. Tier I/O failures never surface here: the
framework turns them into counted misses at the tier boundary.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "KVTierError",
    "RegionError",
    "StateError",
]


class KVTierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is missing or invalid.

    The message always starts with the key path of the offending value
    (``secondary_tiers[1].root_dir``, ``extra_config.cpu_bytes_to_use``) and says what
    was expected. Secret values are never quoted.
    """

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class RegionError(KVTierError):
    """The shared-memory region could not be created, joined or used."""


class StateError(KVTierError):
    """A call does not fit the current state, e.g. loading a key that is not stored.

    Raised before anything changes, so the caller's bookkeeping stays consistent.
    """
