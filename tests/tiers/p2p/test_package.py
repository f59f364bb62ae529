"""The package's shape: its layers import only downwards, and its public names."""

from __future__ import annotations

import ast
from pathlib import Path

import kvtier.tiers.p2p as p2p

# Bottom-up, as the package docstring lists them.
LAYERS = [
    "errors",
    "channel",
    "sockets",
    "memory",
    "wire",
    "handshake",
    "index",
    "context",
    "reader",
    "owner",
    "settings",
    "tier",
]
PACKAGE = Path(p2p.__file__).parent


def p2p_imports(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("kvtier.tiers.p2p."):
                found.add(node.module.rsplit(".", 1)[1])
            elif node.module == "kvtier.tiers.p2p":
                found.add("__init__")
    return found


def test_every_module_of_the_package_has_a_layer():
    modules = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules == set(LAYERS)


def test_each_layer_imports_only_the_layers_below_it():
    for height, module in enumerate(LAYERS):
        above = p2p_imports(module) - set(LAYERS[:height])
        assert not above, f"{module} imports {sorted(above)} from its own layer or above"


def test_the_package_exports_the_tier_its_settings_transports_and_metric_names():
    assert set(p2p.__all__) == {
        "ANNOUNCE_BYTES",
        "ANNOUNCE_FRAMES",
        "ANNOUNCE_KEYS",
        "AUTH_FAILURES",
        "CONNECTIONS",
        "CORRUPT_BACKOFFS",
        "CORRUPT_RECOVERIES",
        "CORRUPT_REPORTS",
        "FRAMES_REJECTED",
        "INDEXED_KEYS",
        "INDEX_MEMORY",
        "REVERIFIED_CHUNKS",
        "SERVED_CHUNKS",
        "Channel",
        "Listener",
        "MemoryTransport",
        "PeerSettings",
        "PeerTier",
        "SocketTransport",
        "Transport",
    }
    assert all(hasattr(p2p, name) for name in p2p.__all__)
    assert p2p.PeerTier.settings_class is p2p.PeerSettings
