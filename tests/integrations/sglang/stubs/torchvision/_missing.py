"""Stand-ins for the names importers take from torchvision and never call here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def stand_in(module: str, name: str) -> Callable[..., Any]:
    """``module.name`` as a function that fails loudly if anything calls it.

    Dunder names raise AttributeError as a real module would, so that import machinery
    and ``hasattr`` probes behave.
    """
    if name.startswith("__"):
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{module}.{name} is part of the import-only torchvision stand-in of the "
            "SGLang tests; no test may run an image operation"
        )

    missing.__name__ = name
    missing.__qualname__ = name
    return missing
