"""Configuration: what the host knows about its engine, and how it is read.

:class:`OffloadingConfig` is the host's description of the engine (block geometry,
parallelism, identity) plus the vLLM-style ``extra_config`` dictionary. Every value is
checked when it is read, and a bad one raises :class:`~kvtier.errors.ConfigError`
whose message starts with the key path, e.g. ``secondary_tiers[1].root_dir``.
"""

from __future__ import annotations

import difflib
import enum
import math
import mmap
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvtier._secrets import redact
from kvtier.errors import ConfigError

__all__ = [
    "FORMAT_VERSION",
    "LAYOUTS",
    "PAGE_SIZE",
    "ChunkGeometry",
    "ConfigReader",
    "OffloadingConfig",
    "chunk_row_bytes",
    "storage_namespace",
]

#: Rows of the primary region are padded to whole pages so every row can be mapped,
#: registered with the GPU driver and read with O_DIRECT on its own.
PAGE_SIZE = mmap.PAGESIZE

#: Version of the byte layout of a chunk (tensor order inside a rank's column). It is
#: part of the storage namespace: a change here must never read old bytes as new.
FORMAT_VERSION = 1

#: How the workers' bytes of one chunk share its row (see :class:`OffloadingConfig`).
LAYOUTS = ("direct", "canonical")

_ENGINE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_REQUIRED: Any = object()
_T = TypeVar("_T")
_E = TypeVar("_E", bound=enum.Enum)


@dataclass(frozen=True)
class OffloadingConfig:
    """What the host knows about its engine.

    ``kv_bytes_per_block`` is what ONE worker (tensor-parallel rank) holds for one GPU
    block, all layers together. ``extra_config`` is the vLLM
    ``kv_connector_extra_config`` dictionary; the spec reads and validates it.

    ``layout`` says how the workers' bytes of a chunk share its row (:data:`LAYOUTS`):

    - ``"direct"``: each rank writes its own column, so the stored bytes depend on
      the number of ranks.
    - ``"canonical"``: the ranks scatter their fragments into one page laid out as if
      there were no parallelism (each worker is given its page map), so engines of any
      tensor-parallel size read each other's chunks. ``canonical_format`` names that
      page layout; it is part of the storage namespace in place of the ranks.

    ``replicated``: every rank holds the same bytes (an MLA model's latent KV under
    tensor parallelism), so a row holds one copy. In the direct layout rank 0 writes
    it; in the canonical one the page maps deal the pages out among the ranks.
    """

    engine_id: str
    kv_bytes_per_block: int
    tokens_per_block: int = 16
    world_size: int = 1
    rank: int = 0
    model_name: str = ""
    kv_dtype: str = ""
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    enable_kv_events: bool = False
    layout: str = "direct"
    canonical_format: str = ""
    replicated: bool = False

    def __repr__(self) -> str:
        # extra_config may hold credentials (S3 keys, the p2p secret): never show them.
        shown = ", ".join(
            f"{name}={redact(value) if name == 'extra_config' else value!r}"
            for name, value in vars(self).items()
        )
        return f"OffloadingConfig({shown})"

    def __post_init__(self) -> None:
        if not isinstance(self.engine_id, str) or not _ENGINE_ID_RE.match(self.engine_id):
            raise ConfigError(
                "engine_id",
                "expected 1-128 characters of letters, digits, '_', '.' or '-' starting "
                f"with a letter or digit (it names a file in /dev/shm), got {self.engine_id!r}",
            )
        _check_int("kv_bytes_per_block", self.kv_bytes_per_block, minimum=1)
        _check_int("tokens_per_block", self.tokens_per_block, minimum=1)
        _check_int("world_size", self.world_size, minimum=1, maximum=1024)
        _check_int("rank", self.rank, minimum=0)
        if self.rank >= self.world_size:
            raise ConfigError(
                "rank", f"expected a rank below world_size={self.world_size}, got {self.rank}"
            )
        for name in ("model_name", "kv_dtype"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(name, "expected a string")
        if not isinstance(self.extra_config, Mapping):
            raise ConfigError(
                "extra_config",
                f"expected a mapping of settings, got {type(self.extra_config).__name__}",
            )
        if not isinstance(self.enable_kv_events, bool):
            raise ConfigError("enable_kv_events", "expected true or false")
        if self.layout not in LAYOUTS:
            raise ConfigError(
                "layout", f"expected one of {', '.join(LAYOUTS)}, got {self.layout!r}"
            )
        if not isinstance(self.replicated, bool):
            raise ConfigError("replicated", "expected true or false")
        if not isinstance(self.canonical_format, str):
            raise ConfigError("canonical_format", "expected a string")
        if (self.layout == "canonical") != bool(self.canonical_format):
            raise ConfigError(
                "canonical_format",
                "names the page layout of a canonical layout, and only of one: "
                f"got {self.canonical_format!r} with layout {self.layout!r}",
            )


def _check_int(path: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(path, f"expected an integer, got {type(value).__name__}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(path, f"expected an integer {bound}, got {value}")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def chunk_row_bytes(kv_bytes_per_block: int, blocks_per_chunk: int, world_size: int) -> int:
    """Bytes of one region row: every worker's column of one chunk, padded to a page."""
    return round_up(kv_bytes_per_block * blocks_per_chunk * world_size, PAGE_SIZE)


@dataclass(frozen=True)
class ChunkGeometry:
    """How chunks map onto the primary region.

    A row of the region holds one chunk: one column of ``column_bytes`` per worker
    rank, then padding up to a whole page (``chunk_bytes``). With a ``shared_column``
    every rank works on the one column of each row instead: one copy of replicated
    bytes, or a canonical page that each rank writes its fragments of.
    """

    tokens_per_block: int
    blocks_per_chunk: int
    world_size: int
    #: Bytes of one column of a row: what one worker holds for one chunk
    #: (kv_bytes_per_block * blocks_per_chunk), or all of them in a canonical page.
    column_bytes: int
    #: Bytes of one row (all workers' columns, padded to the page size).
    chunk_bytes: int
    num_chunks: int
    shared_column: bool = False

    @property
    def columns(self) -> int:
        """Columns of a row: one per rank, or the one every rank shares."""
        return 1 if self.shared_column else self.world_size

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_block * self.blocks_per_chunk

    @property
    def region_bytes(self) -> int:
        return self.chunk_bytes * self.num_chunks

    @classmethod
    def from_config(
        cls, config: OffloadingConfig, *, cpu_bytes_to_use: int, block_size: int
    ) -> ChunkGeometry:
        """Size the region: a chunk's row holds ``blocks_per_chunk`` blocks of every
        worker (one copy when ``replicated``), rounded up to the page size, and
        ``num_chunks = cpu_bytes_to_use // chunk_bytes`` (README, "Configuration
        reference").

        Raises:
            ConfigError: ``block_size`` is not a multiple of ``tokens_per_block``, or
                ``cpu_bytes_to_use`` is too small to hold a single chunk.
        """
        if block_size % config.tokens_per_block:
            raise ConfigError(
                "block_size",
                f"expected a multiple of tokens_per_block={config.tokens_per_block} "
                f"(tokens per chunk), got {block_size}",
            )
        blocks_per_chunk = block_size // config.tokens_per_block
        shared = config.layout == "canonical" or config.replicated
        # How many workers' bytes a row holds: one copy when the ranks hold the same.
        copies = 1 if config.replicated else config.world_size
        column_bytes = config.kv_bytes_per_block * blocks_per_chunk
        if config.layout == "canonical":
            column_bytes *= copies
        chunk_bytes = chunk_row_bytes(config.kv_bytes_per_block, blocks_per_chunk, copies)
        num_chunks = cpu_bytes_to_use // chunk_bytes
        if num_chunks < 1:
            raise ConfigError(
                "cpu_bytes_to_use",
                f"{cpu_bytes_to_use} bytes hold no chunk: one chunk of {block_size} tokens "
                f"takes {chunk_bytes} bytes across {config.world_size} worker(s)",
            )
        return cls(
            tokens_per_block=config.tokens_per_block,
            blocks_per_chunk=blocks_per_chunk,
            world_size=config.world_size,
            column_bytes=column_bytes,
            chunk_bytes=chunk_bytes,
            num_chunks=num_chunks,
            shared_column=shared,
        )


class ConfigReader:
    """Reads one mapping of settings, naming every bad value by its key path.

    ``path`` is the prefix of the mapping (``""`` for the top-level ``extra_config``,
    ``"secondary_tiers[1]"`` for a tier). Every read records its key, so that
    :meth:`reject_unknown` can name any key that nothing read.
    """

    def __init__(self, mapping: object, path: str = "") -> None:
        if not isinstance(mapping, Mapping):
            raise ConfigError(
                path or "extra_config",
                f"expected a mapping of settings, got {type(mapping).__name__}",
            )
        for key in mapping:
            if not isinstance(key, str):
                raise ConfigError(path or "extra_config", f"setting names must be strings: {key!r}")
        self._mapping: Mapping[str, Any] = mapping
        self._path = path
        self._seen: set[str] = set()

    def path_of(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def has(self, key: str) -> bool:
        return key in self._mapping

    def raw(self, key: str, default: Any = None) -> Any:
        self._seen.add(key)
        return self._mapping.get(key, default)

    def _get(self, key: str, default: Any) -> Any:
        self._seen.add(key)
        if key in self._mapping and self._mapping[key] is not None:
            return self._mapping[key]
        if default is _REQUIRED:
            raise ConfigError(self.path_of(key), "is required")
        return default

    def integer(
        self,
        key: str,
        default: Any = _REQUIRED,
        *,
        minimum: int | None = None,
        maximum: int | None = None,
    ) -> Any:
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(self.path_of(key), f"expected an integer, got {_kind(value)}")
        self._check_range(key, value, minimum, maximum)
        return value

    def number(
        self,
        key: str,
        default: Any = _REQUIRED,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
        exclusive_minimum: bool = False,
    ) -> Any:
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(self.path_of(key), f"expected a number, got {_kind(value)}")
        if not math.isfinite(value):
            raise ConfigError(self.path_of(key), f"expected a finite number, got {value}")
        if exclusive_minimum and minimum is not None and value <= minimum:
            raise ConfigError(self.path_of(key), f"expected a number > {minimum}, got {value}")
        self._check_range(key, value, minimum, maximum)
        return float(value)

    def boolean(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if not isinstance(value, bool) and value is not default:
            raise ConfigError(self.path_of(key), f"expected true or false, got {_kind(value)}")
        return value

    def string(
        self,
        key: str,
        default: Any = _REQUIRED,
        *,
        choices: Collection[str] | None = None,
        secret: bool = False,
    ) -> Any:
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if not isinstance(value, str):
            shown = "a value" if secret else _kind(value)
            raise ConfigError(self.path_of(key), f"expected a string, got {shown}")
        if not value:
            raise ConfigError(self.path_of(key), "must not be empty")
        if choices is not None and value not in choices:
            shown = "" if secret else f", got {value!r}"
            raise ConfigError(
                self.path_of(key), f"expected one of {', '.join(sorted(choices))}{shown}"
            )
        return value

    def choice(self, key: str, kind: type[_E], default: Any = _REQUIRED) -> Any:
        """One member of the ``str`` enum ``kind``, named by its value in any case
        (vLLM writes ``"REMOTE"`` where kvtier writes ``"remote"``); ``default`` may be a
        member or its value."""
        values = {member.value.lower(): member.value for member in kind}
        given = self._mapping.get(key)
        if isinstance(given, str) and given.lower() in values:
            self._seen.add(key)
            return kind(values[given.lower()])
        value = self.string(key, default, choices=list(values.values()))
        return kind(value)

    def string_list(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ConfigError(self.path_of(key), f"expected a list of strings, got {_kind(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item:
                raise ConfigError(f"{self.path_of(key)}[{i}]", "expected a non-empty string")
        return list(value)

    def mapping(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(self.path_of(key), f"expected a mapping, got {_kind(value)}")
        return value

    def mapping_list(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(self.path_of(key), f"expected a list of mappings, got {_kind(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, Mapping):
                raise ConfigError(
                    f"{self.path_of(key)}[{i}]", f"expected a mapping, got {_kind(item)}"
                )
        return list(value)

    def reject_unknown(self, allowed: Collection[str] = ()) -> None:
        """Raise for the first key that no read asked for and ``allowed`` does not list."""
        known = self._seen | set(allowed)
        for key in self._mapping:
            if key not in known:
                hint = difflib.get_close_matches(key, sorted(known), n=1)
                suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
                raise ConfigError(
                    self.path_of(key),
                    f"unknown setting{suggestion} (known: {', '.join(sorted(known))})",
                )

    def _check_range(
        self, key: str, value: float, minimum: float | None, maximum: float | None
    ) -> None:
        if minimum is not None and value < minimum:
            raise ConfigError(self.path_of(key), f"expected a value >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise ConfigError(self.path_of(key), f"expected a value <= {maximum}, got {value}")


def _kind(value: object) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value!r}"
    return f"a {type(value).__name__}"


def storage_namespace(config: OffloadingConfig, geometry: ChunkGeometry) -> str:
    """The identity of a chunk's bytes: stores under different namespaces never mix.

    Anything that changes what the bytes of a chunk mean is in it: the model, the KV
    dtype, the chunk geometry, the number of workers and the layout version. A
    canonical row is the same under any number of workers, so the canonical format
    takes the place of the workers and columns; a replicated row holds one worker's
    bytes, whatever the number of workers.
    """
    head = (
        f"kvtier/v{FORMAT_VERSION};model={config.model_name};dtype={config.kv_dtype};"
        f"tokens={geometry.tokens_per_chunk};"
    )
    if config.layout == "canonical":
        return f"{head}canonical={config.canonical_format};chunk={geometry.chunk_bytes}"
    if config.replicated:
        return f"{head}replicated;column={geometry.column_bytes};chunk={geometry.chunk_bytes}"
    return (
        f"{head}world={geometry.world_size};"
        f"column={geometry.column_bytes};chunk={geometry.chunk_bytes}"
    )
