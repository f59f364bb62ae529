"""Specs: the configuration-driven builders of managers and workers."""

from kvtier.specs.base import OffloadingSpec
from kvtier.specs.cpu import CPUOffloadingSpec
from kvtier.specs.factory import OffloadingSpecFactory
from kvtier.specs.tiering import TieringOffloadingSpec

__all__ = ["CPUOffloadingSpec", "OffloadingSpec", "OffloadingSpecFactory", "TieringOffloadingSpec"]
