"""Specs: the configuration-driven builders of managers and workers."""

from kvtier.specs.base import OffloadingSpec
from kvtier.specs.cpu import CPUOffloadingSpec
from kvtier.specs.factory import OffloadingSpecFactory

__all__ = ["CPUOffloadingSpec", "OffloadingSpec", "OffloadingSpecFactory"]
