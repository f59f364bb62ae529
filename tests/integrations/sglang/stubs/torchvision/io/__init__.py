"""Stand-ins: transformers imports ``decode_image`` and ``ImageReadMode`` lazily."""

from typing import Any

from torchvision._missing import stand_in


def __getattr__(name: str) -> Any:
    return stand_in(__name__, name)
