"""What an fs tier's ``root_dir`` holds, and whether every chunk file is sound.

It reads the layout and the chunks through :mod:`kvtier.format` only, as any tool
outside kvtier would.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtier.format import (
    CHUNK_SUFFIX,
    NAMESPACE_FILE,
    TEMP_SUFFIX,
    ChunkFormat,
    NamespaceDescription,
)

__all__ = ["NamespaceReport", "hint", "inspect_root"]


@dataclass
class NamespaceReport:
    directory: str
    namespace: str | None
    model: str | None
    chunk_bytes: int | None
    chunks: int = 0
    bytes: int = 0
    temporary_files: int = 0
    #: Chunk files whose header and checksum were checked and sound; None when the
    #: chunks were counted but not verified.
    verified: int | None = None
    #: File name -> what is wrong with it; None when the chunks were not verified.
    bad: dict[str, str] | None = None


def inspect_root(root: Path, *, verify: bool = False) -> list[NamespaceReport]:
    """One report per namespace directory under ``root``.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        NotADirectoryError: ``root`` is not a directory.
    """
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    reports = []
    for directory, description in _namespaces(root):
        report = NamespaceReport(
            directory=directory.name,
            namespace=description.namespace,
            model=description.model,
            chunk_bytes=description.chunk_bytes,
            verified=0 if verify else None,
            bad={} if verify else None,
        )
        chunk_format = ChunkFormat(report.namespace) if report.namespace else None
        for path in sorted(directory.glob("*/*")):
            if path.name.endswith(TEMP_SUFFIX):
                report.temporary_files += 1
                continue
            if not path.name.endswith(CHUNK_SUFFIX):
                continue
            report.chunks += 1
            report.bytes += path.stat().st_size
            if report.verified is not None and report.bad is not None:
                problem = _verify(path, chunk_format, report.chunk_bytes)
                if problem is None:
                    report.verified += 1
                else:
                    report.bad[str(path.relative_to(root))] = problem
        reports.append(report)
    return reports


def hint(root: Path) -> str:
    """Where to look instead, for a ``root`` holding no namespace directory."""
    if (root / NAMESPACE_FILE).is_file():
        return (
            f"{root} is a namespace directory itself; the fs tier's root_dir is its "
            f"parent: kvtier inspect {root.parent}"
        )
    holding = sorted(
        child for child in root.iterdir() if child.is_dir() and _holds_namespaces(child)
    )
    if holding:
        where = " or ".join(f"kvtier inspect {child}" for child in holding)
        return (
            f"{', '.join(child.name for child in holding)} below it holds kvtier namespaces "
            f"(kvtier bench --root DIR keeps its fs tier in DIR/fs): {where}"
        )
    return (
        "expected an fs tier's root_dir, which holds one <model>_<digest>/namespace.json "
        "per namespace once the tier has started"
    )


def _namespaces(path: Path) -> list[tuple[Path, NamespaceDescription]]:
    """The namespace directories right below ``path``, in name order, with what they hold."""
    children = sorted(child for child in path.iterdir() if child.is_dir())
    found = [(child, _description(child)) for child in children]
    return [(child, description) for child, description in found if description is not None]


def _holds_namespaces(path: Path) -> bool:
    try:
        return bool(_namespaces(path))
    except OSError:  # a directory beside the tier's that this user may not read
        return False


def _description(directory: Path) -> NamespaceDescription | None:
    try:
        return NamespaceDescription.from_json((directory / NAMESPACE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _verify(path: Path, chunk_format: ChunkFormat | None, chunk_bytes: int | None) -> str | None:
    if chunk_format is None or chunk_bytes is None:
        return "namespace.json does not describe the chunks"
    return chunk_format.verify_file(path, chunk_bytes)
