"""``InterpolationMode``, which transformers' image processors import, and stand-ins."""

from enum import Enum
from typing import Any

from torchvision._missing import stand_in


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str) -> Any:
    return stand_in(__name__, name)
