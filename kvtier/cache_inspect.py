"""What an fs tier's ``root_dir`` holds, and whether every chunk file is sound."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.tiers._format import HEADER_BYTES, ChunkFormat
from kvtier.tiers.fs import SUFFIX

__all__ = ["NamespaceReport", "inspect_root"]


@dataclass
class NamespaceReport:
    directory: str
    namespace: str | None
    model: str | None
    chunk_bytes: int | None
    chunks: int = 0
    bytes: int = 0
    temporary_files: int = 0
    verified: int = 0
    #: File name -> what is wrong with it (``--verify`` only).
    bad: dict[str, str] = field(default_factory=dict)


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
    for directory in sorted(p for p in root.iterdir() if p.is_dir()):
        description = _description(directory)
        if description is None:
            continue
        namespace, model, chunk_bytes = (
            description.get("namespace"),
            description.get("model"),
            description.get("chunk_bytes"),
        )
        report = NamespaceReport(
            directory=directory.name,
            namespace=namespace if isinstance(namespace, str) else None,
            model=model if isinstance(model, str) else None,
            chunk_bytes=chunk_bytes if isinstance(chunk_bytes, int) else None,
        )
        chunk_format = ChunkFormat(report.namespace) if report.namespace else None
        for path in sorted(directory.glob("*/*")):
            if path.name.endswith(".tmp"):
                report.temporary_files += 1
                continue
            if not path.name.endswith(SUFFIX):
                continue
            report.chunks += 1
            report.bytes += path.stat().st_size
            if verify:
                problem = _verify(path, chunk_format, report.chunk_bytes)
                if problem is None:
                    report.verified += 1
                else:
                    report.bad[str(path.relative_to(root))] = problem
        reports.append(report)
    return reports


def _description(directory: Path) -> dict[str, object] | None:
    try:
        loaded = json.loads((directory / "namespace.json").read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def _verify(path: Path, chunk_format: ChunkFormat | None, chunk_bytes: int | None) -> str | None:
    if chunk_format is None or not isinstance(chunk_bytes, int):
        return "namespace.json does not describe the chunks"
    try:
        key = bytes.fromhex(path.name[: -len(SUFFIX)])
    except ValueError:
        return "file name is not a key"
    try:
        data = path.read_bytes()
    except OSError as exc:
        return f"unreadable: {os.strerror(exc.errno or 0)}"
    if len(data) != HEADER_BYTES + chunk_bytes:
        return f"{len(data)} bytes, expected {HEADER_BYTES + chunk_bytes}"
    view = memoryview(data)
    return chunk_format.verify(view[:HEADER_BYTES], key, view[HEADER_BYTES:])  # type: ignore[arg-type]
