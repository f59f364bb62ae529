"""Stand-ins: transformers imports this module and calls nothing in it here."""

from typing import Any

from torchvision._missing import stand_in


def __getattr__(name: str) -> Any:
    return stand_in(__name__, name)
