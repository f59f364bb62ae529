"""The tiering engine: the manager that orchestrates the primary and secondary tiers."""

from kvtier.tiering.manager import TieringOffloadingManager

__all__ = ["TieringOffloadingManager"]
