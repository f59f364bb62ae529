"""The stored form of a chunk: what the fs and s3 tiers write, p2p sends and tools read.

This module is the supported way to read or write kvtier's stored chunks from outside
kvtier (``kvtier inspect`` uses nothing else). Everything below is the format of
version :data:`VERSION`; a reader must refuse any other version.

Where chunks live
-----------------

Every namespace (the identity of a chunk's bytes: model, KV dtype, chunk geometry,
number of workers and payload layout version, as one string such as
``kvtier/v1;model=m;dtype=bf16;tokens=64;world=1;column=65536;chunk=65536``) has its
own directory, or object prefix, below the tier's root::

    <root>/<model>_<digest hex>/namespace.json        what the directory holds (fs)
    <root>/<model>_<digest hex>/<hh>/<key hex>.kvt    a chunk file (fs)
    <prefix>/<model>_<digest hex>/<key hex>.kvt       a chunk object (s3: names are flat)

- ``<model>`` is :func:`model_slug` of the model name: only there to help a person tell
  directories apart. The 32 hex digits of ``<digest hex>`` (:attr:`ChunkFormat.digest`)
  are what keep namespaces apart: engines of different namespaces sharing one root
  never see each other's chunks (:func:`namespace_directory`).
- ``<key hex>`` is the chunk's key, lower-case hex (:func:`chunk_name`); ``<hh>`` its
  first two hex digits, one of 256 subdirectories so that no directory grows beyond
  what a filesystem lists quickly (:func:`chunk_path`). A chunk's name is the only
  place its key is found without reading it (:func:`key_of`).
- A file being written is named ``<name>.<pid>.<random hex>.<n>.tmp`` (:func:`temp_name`)
  and renamed into place once whole, so a reader never sees a torn chunk; names ending
  in :data:`TEMP_SUFFIX` are not chunks, and a crash may leave some behind.
- ``namespace.json`` (:class:`NamespaceDescription`) is a JSON object::

      {"kvtier_chunk_format": 1, "namespace": "<the namespace string>",
       "chunk_bytes": <payload bytes of every chunk>, "model": "<the model name>"}

  ``kvtier_chunk_format`` versions these fields, not the chunk header. An fs tier
  writes it when it first starts on a directory and refuses to start on a directory
  whose file names another namespace.

A chunk
-------

A chunk file (or object) is a header of :data:`HEADER_BYTES` (4096) bytes followed by
the payload: the chunk's whole primary-tier row, exactly ``chunk_bytes`` bytes. The
header takes one page, so the payload starts page-aligned and can be read or written
with O_DIRECT straight from or into a primary slot. Integers are little-endian and
unsigned::

    offset  bytes  field
         0      8  magic: the ASCII bytes ``KVTCHUNK`` (MAGIC)
         8      2  format version: 1 (VERSION)
        10      2  key length n, at most 4032 (MAX_KEY_BYTES)
        12      8  payload length in bytes
        20      8  payload checksum: xxh3-64 (seed 0) of the payload
        28     16  namespace digest: the first 16 bytes of SHA-256 of the namespace
                   string encoded as UTF-8
        44      8  header checksum: xxh3-64 (seed 0) of bytes 0-43 followed by the key
        52     12  zero
        64      n  the key (KEY_OFFSET)
      64+n      -  zero, up to offset 4096
      4096         the payload

The zero bytes are written as zeros and never read: no checksum covers them, and
nothing in them changes what a chunk holds. xxh3-64 was chosen for the payload
checksum for its speed (27 GB/s on one core where this was measured, against 4 GB/s for
zlib's crc32): verifying a 2 MiB chunk costs about 75 us.

What makes a chunk servable
---------------------------

A reader that wants key K of namespace N with payloads of ``chunk_bytes`` bytes serves
a stored chunk only when all of these hold, checked in this order by
:meth:`ChunkFormat.verify` (each failure has its own reason):

1. the header is whole (``truncated header``) and starts with the magic (``not a
   kvtier chunk``);
2. the format version is :data:`VERSION` (``format version V, expected 1``);
3. the key length fits the header (``corrupt header``);
4. the header checksum matches (``header checksum mismatch``): a damaged length,
   checksum, digest or key byte ends here;
5. the namespace digest is N's (``foreign namespace``);
6. the stored key is K (``another key``): a chunk copied or linked under another name
   is never served for that name;
7. the payload length is ``chunk_bytes`` (``payload of L bytes, expected B``);
8. the payload checksum matches (``payload checksum mismatch``).

A file must also be exactly ``HEADER_BYTES + chunk_bytes`` long: the fs tier reports a
shorter one as ``truncated file`` and a longer one as ``trailing bytes``,
:meth:`ChunkFormat.verify_file` (and so ``kvtier inspect --verify``) as ``S bytes,
expected T``. A tier never serves a chunk that fails: it counts it as an integrity
failure, removes it so that it is stored again whole, and reports a miss. A read of a
chunk that is not stored at all reports :data:`MISSING`, a plain miss.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvtier.keys import OffloadKey

__all__ = [
    "CHUNK_SUFFIX",
    "HEADER_BYTES",
    "KEY_OFFSET",
    "MAGIC",
    "MAX_KEY_BYTES",
    "MISSING",
    "NAMESPACE_FILE",
    "TEMP_SUFFIX",
    "VERSION",
    "ChunkFormat",
    "NamespaceDescription",
    "chunk_name",
    "chunk_path",
    "key_of",
    "model_slug",
    "namespace_directory",
    "temp_name",
]

#: Bytes of a chunk's header: one page, so that the payload after it is page-aligned.
HEADER_BYTES = 4096
#: The first eight bytes of every chunk.
MAGIC = b"KVTCHUNK"
#: The version of the header this module reads and writes.
VERSION = 1
#: Where the key starts in the header.
KEY_OFFSET = 64
#: The longest key a header holds.
MAX_KEY_BYTES = HEADER_BYTES - KEY_OFFSET
#: The end of a chunk's file or object name.
CHUNK_SUFFIX = ".kvt"
#: The end of the name of a file being written, until it is renamed into place.
TEMP_SUFFIX = ".tmp"
#: The file in each namespace directory that describes its chunks.
NAMESPACE_FILE = "namespace.json"
#: What a tier's read reports for a chunk that is not stored: a plain miss, not a
#: verification failure.
MISSING = "missing"

# magic, version, key length, payload length, payload checksum, namespace digest
_FIELDS = struct.Struct("<8sHHQQ16s")
_HEADER_SUM = struct.Struct("<Q")
_DIGEST_BYTES = 16
# Version of namespace.json's own fields, so that a future reader can tell them apart.
_DESCRIPTION_VERSION = 1
_MODEL_SLUG = re.compile(r"[^A-Za-z0-9._-]+")
# Room for a readable model name; the digest that follows is what keeps them apart.
_MODEL_SLUG_CHARS = 64


class ChunkFormat:
    """Writes and verifies the headers of one namespace's chunks.

    Only the namespace varies between chunk formats: one instance serves every chunk
    of its namespace, from any thread (it holds no mutable state).
    """

    def __init__(self, namespace: str) -> None:
        #: The namespace string, as the engine built it.
        self.namespace = namespace
        #: The 16 bytes every header of this namespace carries: the first 16 bytes of
        #: SHA-256 of the namespace string encoded as UTF-8.
        self.digest = hashlib.sha256(namespace.encode()).digest()[:_DIGEST_BYTES]

    @property
    def digest_hex(self) -> str:
        """:attr:`digest` as 32 lower-case hex digits, as namespace directories end."""
        return self.digest.hex()

    def pack_header(
        self,
        into: memoryview | bytearray,
        key: OffloadKey,
        payload: memoryview,
        checksum: int | None = None,
    ) -> None:
        """Write the header of ``key``'s chunk holding ``payload`` into ``into``.

        ``into`` holds at least :data:`HEADER_BYTES` bytes; its first
        :data:`HEADER_BYTES` are overwritten, padding included. ``checksum`` is
        :meth:`checksum` of ``payload`` when the caller took it earlier (it is then
        trusted, not recomputed).

        Raises:
            ValueError: ``key`` is longer than :data:`MAX_KEY_BYTES`.
        """
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"a key of {len(key)} bytes does not fit the header")
        if checksum is None:
            checksum = self.checksum(payload)
        fields = _FIELDS.pack(MAGIC, VERSION, len(key), len(payload), checksum, self.digest)
        into[: _FIELDS.size] = fields
        into[KEY_OFFSET : KEY_OFFSET + len(key)] = key
        into[KEY_OFFSET + len(key) : HEADER_BYTES] = bytes(HEADER_BYTES - KEY_OFFSET - len(key))
        header_sum = xxhash.xxh3_64_intdigest(fields + key)
        into[_FIELDS.size : _FIELDS.size + _HEADER_SUM.size] = _HEADER_SUM.pack(header_sum)
        padding_start = _FIELDS.size + _HEADER_SUM.size
        into[padding_start:KEY_OFFSET] = bytes(KEY_OFFSET - padding_start)

    @staticmethod
    def checksum(payload: memoryview | bytes) -> int:
        """The payload checksum a header carries: xxh3-64 of ``payload``, seed 0."""
        return xxhash.xxh3_64_intdigest(payload)

    def header(self, key: OffloadKey, payload: memoryview) -> bytearray:
        """A new header of ``key``'s chunk holding ``payload`` (see :meth:`pack_header`)."""
        buffer = bytearray(HEADER_BYTES)
        self.pack_header(buffer, key, payload)
        return buffer

    def verify(
        self, header: memoryview | bytes | bytearray, key: OffloadKey, payload: memoryview
    ) -> str | None:
        """Whether ``header`` + ``payload`` are ``key``'s chunk of this namespace.

        ``payload`` has the length the reader expects (its slot's, or the
        namespace's ``chunk_bytes``). Returns None when the chunk may be served, else
        the reason it may not, one of those listed in this module's documentation.
        """
        if len(header) < HEADER_BYTES:
            return "truncated header"
        magic, version, key_len, payload_len, checksum, digest = _FIELDS.unpack_from(header, 0)
        if magic != MAGIC:
            return "not a kvtier chunk"
        if version != VERSION:
            return f"format version {version}, expected {VERSION}"
        if key_len > MAX_KEY_BYTES:
            return "corrupt header"
        stored_key = bytes(header[KEY_OFFSET : KEY_OFFSET + key_len])
        (header_sum,) = _HEADER_SUM.unpack_from(header, _FIELDS.size)
        if header_sum != xxhash.xxh3_64_intdigest(bytes(header[: _FIELDS.size]) + stored_key):
            return "header checksum mismatch"
        if digest != self.digest:
            return "foreign namespace"
        if stored_key != key:
            return "another key"
        if payload_len != len(payload):
            return f"payload of {payload_len} bytes, expected {len(payload)}"
        if checksum != xxhash.xxh3_64_intdigest(payload):
            return "payload checksum mismatch"
        return None

    def verify_file(self, path: Path, chunk_bytes: int) -> str | None:
        """Whether the chunk file at ``path`` is sound: None, else what is wrong.

        The key is the one the file's name gives (:func:`key_of`); the file must be
        exactly :data:`HEADER_BYTES` + ``chunk_bytes`` long and pass :meth:`verify`.
        Besides :meth:`verify`'s reasons: ``file name is not a key``, ``unreadable:
        <error>`` and ``<size> bytes, expected <size>``. Reads the whole file with
        blocking I/O: call it from a thread in async code.
        """
        key = key_of(path.name)
        if key is None:
            return "file name is not a key"
        try:
            data = path.read_bytes()
        except OSError as exc:
            return f"unreadable: {os.strerror(exc.errno or 0)}"
        if len(data) != HEADER_BYTES + chunk_bytes:
            return f"{len(data)} bytes, expected {HEADER_BYTES + chunk_bytes}"
        view = memoryview(data)
        return self.verify(view[:HEADER_BYTES], key, view[HEADER_BYTES:])

    @staticmethod
    def stored_key(header: memoryview | bytes | bytearray) -> bytes | None:
        """The key a header names, or None if it is not a kvtier header.

        Nothing is verified: a damaged header may name any key.
        """
        if len(header) < _FIELDS.size or bytes(header[: len(MAGIC)]) != MAGIC:
            return None
        key_len = _FIELDS.unpack_from(header, 0)[2]
        if key_len > MAX_KEY_BYTES:
            return None
        return bytes(header[KEY_OFFSET : KEY_OFFSET + key_len])


# ------------------------------------------------------------------ names


def model_slug(model_name: str) -> str:
    """``model_name`` as a directory name: runs of other characters than letters,
    digits, ``.``, ``_`` and ``-`` become one ``_``, cut to 64 characters, ``model``
    when nothing is left."""
    return _MODEL_SLUG.sub("_", model_name).strip("_")[:_MODEL_SLUG_CHARS] or "model"


def namespace_directory(model_name: str, chunk_format: ChunkFormat) -> str:
    """The name of the directory (or object prefix) holding one namespace's chunks:
    ``<model slug>_<digest hex>``."""
    return f"{model_slug(model_name)}_{chunk_format.digest_hex}"


def chunk_name(key: OffloadKey) -> str:
    """The file or object name of ``key``'s chunk: ``<key hex>.kvt``."""
    return f"{key.hex()}{CHUNK_SUFFIX}"


def chunk_path(key: OffloadKey) -> str:
    """``key``'s chunk file relative to the namespace directory: ``<hh>/<key hex>.kvt``.

    The first byte of the key picks one of 256 subdirectories, so no directory grows
    beyond what a filesystem lists quickly.
    """
    name = chunk_name(key)
    return f"{name[:2]}/{name}"


def key_of(name: str) -> OffloadKey | None:
    """The key a chunk file or object is named for, or None if it is not a chunk's name."""
    if not name.endswith(CHUNK_SUFFIX):
        return None
    try:
        return OffloadKey(bytes.fromhex(name[: -len(CHUNK_SUFFIX)]))
    except ValueError:
        return None


_writer: tuple[int, str] = (0, "")
_temp_serial = itertools.count()


def temp_name(name: str) -> str:
    """A name to write ``name`` under before it is renamed into place.

    Unique per process and call, so that writers of the same chunk never share one:
    the process id and a random tag drawn once per process (other hosts writing to
    a shared directory), then a serial number. The random draw per call this replaced
    cost a system call per chunk written.
    """
    global _writer
    pid = os.getpid()
    if _writer[0] != pid:  # first call, or a forked child: a tag of its own
        _writer = (pid, f"{pid}.{secrets.token_hex(4)}")
    return f"{name}.{_writer[1]}.{next(_temp_serial)}{TEMP_SUFFIX}"


# -------------------------------------------------------- namespace.json


@dataclass(frozen=True)
class NamespaceDescription:
    """What ``namespace.json`` says about the chunks of its directory.

    A field missing from the file, or of the wrong type, reads as None.
    """

    #: The namespace string: :class:`ChunkFormat` of it verifies the chunks.
    namespace: str | None
    #: The payload bytes of every chunk of the directory.
    chunk_bytes: int | None
    #: The model name, as the engine was configured with it.
    model: str | None

    def to_json(self) -> str:
        """The text of a ``namespace.json`` holding this description."""
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
