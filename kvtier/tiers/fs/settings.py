"""The fs tier's parameters, parsed once and derived for the engine's chunk size."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvtier.errors import ConfigError
from kvtier.tiers._depth import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MIN_DEPTH,
    DEFAULT_START_DEPTH,
    DepthRange,
)
from kvtier.tiers.kit import ConfigReader, derived_field

__all__ = ["AUTO", "DEEP_START_BYTES", "MAX_WRITE_DEPTH", "START_DEPTH", "FsSettings"]

# Far beyond any useful depth (the measured optima were 4 to 16): a typo, not a tuning.
_MAX_DEPTH = 256
AUTO: Literal["auto"] = "auto"
# Where an adaptive depth starts, both ways. Measured with benchmarks/vs_vllm.py (4 GiB
# of 2 MiB chunks) with no file removed in the minutes before (removals had made every
# file creation CPU-bound, which favoured low depths): stores from depth 4 ran at
# 1.34-1.35 GB/s (the depth had climbed to 7 when the 2-3 s burst ended), at 1.65 from
# 16 and 1.59-2.31 from 32, at less CPU per GiB (0.55-0.60 s against 0.68-0.70);
# promotions at 1.55-1.61 GB/s from 4 and 1.74-1.92 at 16, the median request waiting
# 230-252 ms against 319-327. A burst is often over before a climb from 4 gets far, and
# a depth that does not pay is stepped down.
START_DEPTH = 16
# Chunks smaller than this start at DEFAULT_START_DEPTH (4) instead: creating and
# opening their files costs more CPU than moving their bytes, and more threads on few
# cores only contend for it. kvtier inside SGLang (benchmarks/sglang_backend.py) with
# 32 KiB pages, from 16: 2631 pages/s to disk at 20.2 CPU-s per GiB and cold loads of
# 5149/s at 8.4; at 4: 4174/s at 12.7 and 7179/s at 4.8. At 768 KiB pages the deeper
# start won on both (to disk 1.44 against 1.04 GB/s at 0.61 against 0.76 s per GiB).
DEEP_START_BYTES = 256 << 10
# The most an adaptive write depth goes up to: vLLM's tiering writes on all 32 of its
# threads while nothing is read (each takes the other queue when its own is empty).
# Reads stop at DEFAULT_MAX_DEPTH.
MAX_WRITE_DEPTH = 32


@dataclass(frozen=True)
class FsSettings:
    """The fs tier's parameters (``{"type": "fs", "root_dir": ...}``)."""

    #: The directory under which each namespace gets a directory of its own. Required;
    #: ``~`` is expanded for the engine (:meth:`for_chunks`). Created at start if it is
    #: missing, but only if its parent exists: a missing parent is an error.
    root_dir: Path
    #: Bytes of chunk files the tier keeps; beyond it the least recently used files are
    #: removed. None (the default): no limit but the filesystem's.
    capacity_bytes: int | None = None
    #: Chunk files read at once: ``"auto"`` (the default) adapts the depth to what the
    #: disk delivers, starting at 16 (4 for chunks under 256 KiB), between
    #: ``min_depth`` and ``max_read_depth``; a number fixes it. ``io_concurrency``
    #: sets this and ``write_depth`` together; either one given on its own wins over it.
    read_depth: int | Literal["auto"] = AUTO
    #: Chunk files written at once; see ``read_depth`` (bounded by ``max_write_depth``).
    write_depth: int | Literal["auto"] = AUTO
    #: The least an adaptive depth goes down to (2); a fixed depth ignores it.
    min_depth: int = DEFAULT_MIN_DEPTH
    #: The most an adaptive read depth goes up to (16, vLLM's read threads); a fixed
    #: one ignores it.
    max_read_depth: int = DEFAULT_MAX_DEPTH
    #: The most an adaptive write depth goes up to (32: vLLM's 16 read and 16 write
    #: threads all write while nothing is read).
    max_write_depth: int = MAX_WRITE_DEPTH
    #: Write and read without the page cache: ``"auto"`` where the filesystem supports
    #: it (probed at start), true to require it, false never.
    o_direct: bool | Literal["auto"] = "auto"
    #: Flush each file to the device before it becomes visible (false): a crash of the
    #: machine may otherwise leave files of the last seconds empty (they then fail
    #: verification and count as misses).
    fsync: bool = False
    #: Other processes or nodes may write to the same ``root_dir`` (true): a key the
    #: tier's index does not know is looked for on disk before it is called a miss.
    shared: bool = True
    #: Where an adaptive depth starts, both ways. Not a parameter: derived from the
    #: engine's chunk size (:meth:`for_chunks`), 16 for chunks of 256 KiB and more, 4
    #: below.
    start_depth: int = derived_field(START_DEPTH)

    @classmethod
    def from_params(cls, params: Mapping[str, Any], path: str) -> FsSettings:
        """Read the fs tier's parameters; errors name ``path.<parameter>``."""
        reader = ConfigReader(params, path)
        root_dir = Path(reader.string("root_dir"))
        capacity_bytes = reader.integer("capacity_bytes", None, minimum=1)
        both = _depth(reader, "io_concurrency", AUTO)
        read_depth = _depth(reader, "read_depth", both)
        write_depth = _depth(reader, "write_depth", both)
        min_depth = reader.integer("min_depth", DEFAULT_MIN_DEPTH, minimum=1, maximum=_MAX_DEPTH)
        max_read_depth = _bound(reader, "max_read_depth", min_depth, DEFAULT_MAX_DEPTH)
        max_write_depth = _bound(reader, "max_write_depth", min_depth, MAX_WRITE_DEPTH)
        o_direct = reader.raw("o_direct", "auto")
        if o_direct not in ("auto", True, False):
            raise ConfigError(reader.path_of("o_direct"), 'expected "auto", true or false')
        fsync = reader.boolean("fsync", False)
        shared = reader.boolean("shared", True)
        reader.reject_unknown()
        return cls(
            root_dir=root_dir,
            capacity_bytes=capacity_bytes,
            read_depth=read_depth,
            write_depth=write_depth,
            min_depth=min_depth,
            max_read_depth=max_read_depth,
            max_write_depth=max_write_depth,
            o_direct=o_direct,
            fsync=fsync,
            shared=shared,
        )

    def for_chunks(self, chunk_bytes: int) -> FsSettings:
        """These settings for chunks of ``chunk_bytes``: :attr:`start_depth` filled in,
        and ``~`` in :attr:`root_dir` expanded."""
        small = chunk_bytes < DEEP_START_BYTES
        return dataclasses.replace(
            self,
            root_dir=self.root_dir.expanduser(),
            start_depth=DEFAULT_START_DEPTH if small else START_DEPTH,
        )

    @property
    def read_range(self) -> DepthRange:
        """The read depths the tier may run at."""
        return self._range(self.read_depth, self.max_read_depth)

    @property
    def write_range(self) -> DepthRange:
        """The write depths the tier may run at."""
        return self._range(self.write_depth, self.max_write_depth)

    def _range(self, depth: int | str, maximum: int) -> DepthRange:
        if isinstance(depth, int):
            return DepthRange.fixed(depth)
        return DepthRange.adaptive(self.min_depth, maximum, self.start_depth)


def _depth(reader: ConfigReader, key: str, default: int | Literal["auto"]) -> int | Literal["auto"]:
    """A depth setting: ``"auto"`` or a number of operations in flight."""
    value = reader.raw(key)
    if value is None:
        return default
    if value == AUTO:
        return AUTO
    if isinstance(value, str):
        raise ConfigError(reader.path_of(key), f'expected "auto" or an integer, got {value!r}')
    depth: int = reader.integer(key, default, minimum=1, maximum=_MAX_DEPTH)
    return depth


def _bound(reader: ConfigReader, key: str, min_depth: int, default: int) -> int:
    """``max_read_depth`` / ``max_write_depth``, no lower than ``min_depth``."""
    value: int = reader.integer(key, default, minimum=1, maximum=_MAX_DEPTH)
    if value < min_depth:
        raise ConfigError(
            reader.path_of(key), f"expected a value >= min_depth ({min_depth}), got {value}"
        )
    return value
