"""The filesystem tier: one verified file per chunk under a namespaced directory.

Layout::

    <root_dir>/<model>_<namespace digest>/namespace.json
    <root_dir>/<model>_<namespace digest>/<hh>/<key hex>.kvt

Each file is a one-page header (magic, version, key, length, checksums) followed by
the chunk's primary row (see :mod:`kvtier.format`). A file is written under a
unique temporary name and renamed into place, so a reader never sees a torn file; a
crash leaves at most a temporary file, which the next start removes. Every load is
verified before the chunk is reported loaded: a corrupt, truncated or foreign file is a
failed load, removed and counted, never served.

Data path: ``os.pwritev`` / ``os.preadv`` straight between the file and the region's
memoryview (one copy, no ``bytes`` per chunk), on a few threads of the tier's own per
direction (:mod:`kvtier.tiers._threads`), as many at once as the queue depth, which
follows what the disk delivers unless a fixed depth is set (:mod:`kvtier.tiers._depth`).
aiofiles would add two thread hops and a new ``bytes`` per read; it measured lag spikes
of up to 40 ms here, so it serves only the metadata side (directories,
``namespace.json``).

An in-memory index (key -> size, least recently used first) answers lookups at once
and drives ``capacity_bytes`` eviction. It is rebuilt at start by a background scan
ordered by modification time, which loads refresh, so recency survives restarts. With
``shared`` (the default) a key the index does not know is looked for on disk too, so
another process or node writing to the same ``root_dir`` is seen.

The modules: :mod:`~kvtier.tiers.fs.settings` (:class:`FsSettings`, the parameters and
the depths they give), :mod:`~kvtier.tiers.fs.files` (listing, probing and reading
chunk files, on threads) and :mod:`~kvtier.tiers.fs.tier` (:class:`FileSystemTier`:
the index, stores, loads and eviction).
"""

from kvtier.tiers.fs.files import MTIME_REFRESH_S, STALE_TMP_S
from kvtier.tiers.fs.settings import FsSettings
from kvtier.tiers.fs.tier import EVICTED_CHUNKS, USED_BYTES, FileSystemTier

__all__ = [
    "EVICTED_CHUNKS",
    "MTIME_REFRESH_S",
    "STALE_TMP_S",
    "USED_BYTES",
    "FileSystemTier",
    "FsSettings",
]
