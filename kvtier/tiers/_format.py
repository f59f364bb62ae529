"""The stored form of one chunk, shared by the file and object tiers.

    offset 0     header: magic, format version, key length, payload length,
                 payload checksum, namespace digest, header checksum
    offset 64    the key bytes, then zero padding
    offset 4096  payload: the chunk's whole primary row

The header takes one page, so the payload starts page-aligned in a file and can be
read or written with O_DIRECT straight from or into a primary slot. The payload
checksum is xxh3-64 (27 GB/s on one core here, against 4 GB/s for zlib's crc32), so
verifying a 2 MiB chunk costs about 75 us. A chunk is served only when the magic,
version, key, namespace, length, header checksum and payload checksum all match.
"""

from __future__ import annotations

import hashlib
import struct

import xxhash

from kvtier.keys import OffloadKey

__all__ = [
    "HEADER_BYTES",
    "MAX_KEY_BYTES",
    "ChunkFormat",
]

HEADER_BYTES = 4096
_MAGIC = b"KVTCHUNK"
_VERSION = 1
# magic, version, key length, payload length, payload checksum, namespace digest
_FIELDS = struct.Struct("<8sHHQQ16s")
_HEADER_SUM = struct.Struct("<Q")
_KEY_OFFSET = 64
MAX_KEY_BYTES = HEADER_BYTES - _KEY_OFFSET


class ChunkFormat:
    """Encodes and verifies chunks of one namespace."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.digest = hashlib.sha256(namespace.encode()).digest()[:16]

    @property
    def digest_hex(self) -> str:
        return self.digest.hex()

    def pack_header(
        self,
        into: memoryview | bytearray,
        key: OffloadKey,
        payload: memoryview,
        checksum: int | None = None,
    ) -> None:
        """Write the header of ``key`` with ``payload`` into the first page of ``into``.

        ``checksum`` is :meth:`checksum` of the payload when the caller took it earlier.
        """
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"a key of {len(key)} bytes does not fit the header")
        if checksum is None:
            checksum = self.checksum(payload)
        fields = _FIELDS.pack(_MAGIC, _VERSION, len(key), len(payload), checksum, self.digest)
        into[: _FIELDS.size] = fields
        into[_KEY_OFFSET : _KEY_OFFSET + len(key)] = key
        into[_KEY_OFFSET + len(key) : HEADER_BYTES] = bytes(HEADER_BYTES - _KEY_OFFSET - len(key))
        header_sum = xxhash.xxh3_64_intdigest(bytes(into[: _FIELDS.size]) + key)
        into[_FIELDS.size : _FIELDS.size + _HEADER_SUM.size] = _HEADER_SUM.pack(header_sum)

    @staticmethod
    def checksum(payload: memoryview | bytes) -> int:
        """The payload checksum a header carries."""
        return xxhash.xxh3_64_intdigest(payload)

    def header(self, key: OffloadKey, payload: memoryview) -> bytearray:
        buffer = bytearray(HEADER_BYTES)
        self.pack_header(buffer, key, payload)
        return buffer

    def verify(
        self, header: memoryview | bytes | bytearray, key: OffloadKey, payload: memoryview
    ) -> str | None:
        """None when ``header`` + ``payload`` hold ``key``'s chunk of this namespace, else why."""
        if len(header) < HEADER_BYTES:
            return "truncated header"
        magic, version, key_len, payload_len, checksum, digest = _FIELDS.unpack_from(header, 0)
        if magic != _MAGIC:
            return "not a kvtier chunk"
        if version != _VERSION:
            return f"format version {version}, expected {_VERSION}"
        if key_len > MAX_KEY_BYTES:
            return "corrupt header"
        stored_key = bytes(header[_KEY_OFFSET : _KEY_OFFSET + key_len])
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

    @staticmethod
    def stored_key(header: memoryview | bytes | bytearray) -> bytes | None:
        """The key a header names, or None if it is not a kvtier header."""
        if len(header) < _FIELDS.size or bytes(header[:8]) != _MAGIC:
            return None
        key_len = _FIELDS.unpack_from(header, 0)[2]
        if key_len > MAX_KEY_BYTES:
            return None
        return bytes(header[_KEY_OFFSET : _KEY_OFFSET + key_len])
