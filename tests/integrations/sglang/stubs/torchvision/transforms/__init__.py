"""``torchvision.transforms``: ``InterpolationMode`` and stand-ins for the rest."""

from typing import Any

from torchvision._missing import stand_in
from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode"]


def __getattr__(name: str) -> Any:
    return stand_in(__name__, name)
