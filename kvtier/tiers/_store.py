"""Where stored chunks live, and what becomes of one that fails verification.

The fs and s3 tiers keep chunks in the same layout, and ``kvtier inspect`` reads it::

    <model>_<namespace digest>/namespace.json        what the directory holds (fs)
    <model>_<namespace digest>/<hh>/<key hex>.kvt    a chunk file (fs: 256 subdirectories)
    <model>_<namespace digest>/<key hex>.kvt         a chunk object (s3: names are flat)

Each chunk is stored in the form of :mod:`kvtier.tiers._format`. The directory name
carries the namespace digest, so engines of different namespaces sharing one root (or
bucket prefix) never see each other's chunks; the model part only helps a person tell
the directories apart.

A chunk that fails verification is never served: the tier counts it as an integrity
failure, removes it so that it is stored again whole, and says so in one log line per
operation (:class:`CorruptChunks`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from kvtier._logs import ThrottledLog
from kvtier.keys import OffloadKey
from kvtier.tiers._format import ChunkFormat
from kvtier.tiers.base import TierContext

__all__ = [
    "MISSING",
    "NAMESPACE_FILE",
    "SUFFIX",
    "TEMP_SUFFIX",
    "CorruptChunks",
    "NamespaceDescription",
    "chunk_name",
    "chunk_path",
    "key_of",
    "model_slug",
    "namespace_directory",
    "temp_name",
]

SUFFIX = ".kvt"
#: Files being written end so until they are renamed into place.
TEMP_SUFFIX = ".tmp"
NAMESPACE_FILE = "namespace.json"
#: What a read reports for a chunk that is not stored (a plain miss, not corruption).
MISSING = "missing"
# Version of namespace.json's own fields, so a future reader can tell them apart.
_DESCRIPTION_VERSION = 1
_MODEL_SLUG = re.compile(r"[^A-Za-z0-9._-]+")
# Room for a readable model name; the digest that follows is what keeps them apart.
_MODEL_SLUG_CHARS = 64


def model_slug(model_name: str) -> str:
    """``model_name`` as a directory name: other characters become ``_``."""
    return _MODEL_SLUG.sub("_", model_name).strip("_")[:_MODEL_SLUG_CHARS] or "model"


def namespace_directory(model_name: str, chunk_format: ChunkFormat) -> str:
    """The name of the directory (or object prefix) holding one namespace's chunks."""
    return f"{model_slug(model_name)}_{chunk_format.digest_hex}"


def chunk_name(key: OffloadKey) -> str:
    """The file or object name of ``key``'s chunk."""
    return f"{key.hex()}{SUFFIX}"


def chunk_path(key: OffloadKey) -> str:
    """``key``'s chunk file relative to the namespace directory: ``<hh>/<key hex>.kvt``.

    The first byte of the key picks one of 256 subdirectories, so no directory grows
    beyond what a filesystem lists quickly.
    """
    name = chunk_name(key)
    return f"{name[:2]}/{name}"


def key_of(name: str) -> OffloadKey | None:
    """The key a chunk file or object is named for, or None if it is not a chunk."""
    if not name.endswith(SUFFIX):
        return None
    try:
        return OffloadKey(bytes.fromhex(name[: -len(SUFFIX)]))
    except ValueError:
        return None


def temp_name(name: str) -> str:
    """A name to write ``name`` under before it is renamed into place.

    Unique per process and call, so that writers of the same chunk never share one.
    """
    return f"{name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


@dataclass(frozen=True)
class NamespaceDescription:
    """What ``namespace.json`` says about the chunks of its directory.

    A field of the wrong type in the file reads as None.
    """

    namespace: str | None
    chunk_bytes: int | None
    model: str | None

    def to_json(self) -> str:
        fields = {
            "kvtier_chunk_format": _DESCRIPTION_VERSION,
            "namespace": self.namespace,
            "chunk_bytes": self.chunk_bytes,
            "model": self.model,
        }
        return json.dumps(fields, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> NamespaceDescription | None:
        """The description in ``text``; None when it holds no JSON object.

        Raises:
            ValueError: ``text`` is not JSON.
        """
        loaded = json.loads(text)
        if not isinstance(loaded, dict):
            return None
        namespace, chunk_bytes, model = (
            loaded.get("namespace"),
            loaded.get("chunk_bytes"),
            loaded.get("model"),
        )
        return cls(
            namespace=namespace if isinstance(namespace, str) else None,
            chunk_bytes=(
                chunk_bytes
                if isinstance(chunk_bytes, int) and not isinstance(chunk_bytes, bool)
                else None
            ),
            model=model if isinstance(model, str) else None,
        )


class CorruptChunks:
    """A tier's handling of stored chunks that failed verification.

    ``where`` gives a chunk's location (a path, a URL) for the log line.
    """

    def __init__(
        self, ctx: TierContext, log: ThrottledLog, where: Callable[[OffloadKey], object]
    ) -> None:
        self._ctx = ctx
        self._log = log
        self._where = where

    async def discard(
        self,
        problems: Mapping[OffloadKey, str],
        during: str,
        remove: Callable[[Sequence[OffloadKey]], Awaitable[Sequence[OffloadKey]]],
    ) -> Sequence[OffloadKey]:
        """Count, remove and report chunks found corrupt ``during`` one operation.

        ``problems`` maps each key to what was wrong with its chunk. ``remove``
        deletes chunks by key and returns the keys it removed; it must not raise (a
        chunk it could not remove fails verification again next time). Returns the
        keys whose chunks were removed.
        """
        if not problems:
            return []
        self._ctx.report_integrity_failure(len(problems))
        removed = await remove(list(problems))
        self._log.warning(
            "corrupt",
            "%d stored chunk(s) failed verification during %s (%s), e.g. %s; "
            "%d removed, never served",
            len(problems),
            during,
            ", ".join(sorted(set(problems.values()))),
            self._where(next(iter(problems))),
            len(removed),
        )
        return removed
