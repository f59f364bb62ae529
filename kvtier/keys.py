"""Offload keys: the name of one offloaded chunk.

A key is the raw bytes of a block hash followed by the 4-byte big-endian index of the
KV-cache group the block belongs to. This is the encoding vLLM uses, so keys computed
by either system name the same chunk. Keys are plain ``bytes`` (no tuple or object per
key), which keeps the scheduler's hot dictionaries small and fast.
"""

from __future__ import annotations

from typing import NewType

__all__ = [
    "GROUP_IDX_BYTES",
    "OffloadKey",
    "format_key",
    "key_block_hash",
    "key_group_idx",
    "make_offload_key",
]

OffloadKey = NewType("OffloadKey", bytes)

GROUP_IDX_BYTES = 4
_MAX_GROUP_IDX = (1 << (8 * GROUP_IDX_BYTES)) - 1


def make_offload_key(block_hash: bytes, group_idx: int = 0) -> OffloadKey:
    """Build the key of the block ``block_hash`` in KV-cache group ``group_idx``.

    Raises:
        TypeError: ``block_hash`` is not bytes-like.
        ValueError: ``block_hash`` is empty, or ``group_idx`` does not fit in 4 bytes.
    """
    if not isinstance(block_hash, (bytes, bytearray, memoryview)):
        raise TypeError(f"block_hash must be bytes, not {type(block_hash).__name__}")
    if len(block_hash) == 0:
        raise ValueError("block_hash must not be empty")
    if not 0 <= group_idx <= _MAX_GROUP_IDX:
        raise ValueError(f"group_idx must be in [0, {_MAX_GROUP_IDX}], got {group_idx}")
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(GROUP_IDX_BYTES, "big"))


def key_block_hash(key: OffloadKey) -> bytes:
    """The block-hash part of ``key``."""
    _check_key(key)
    return key[:-GROUP_IDX_BYTES]


def key_group_idx(key: OffloadKey) -> int:
    """The KV-cache group index of ``key``."""
    _check_key(key)
    return int.from_bytes(key[-GROUP_IDX_BYTES:], "big")


def _check_key(key: bytes) -> None:
    if len(key) <= GROUP_IDX_BYTES:
        raise ValueError(
            f"an offload key holds a block hash and a {GROUP_IDX_BYTES}-byte group index; "
            f"got {len(key)} bytes"
        )


def format_key(key: bytes) -> str:
    """A short, readable form of a key for messages: hash prefix and group index."""
    if len(key) <= GROUP_IDX_BYTES:
        return key.hex()
    block_hash = key[:-GROUP_IDX_BYTES]
    shown = block_hash[:8].hex() + ("…" if len(block_hash) > 8 else "")
    return f"{shown}/g{int.from_bytes(key[-GROUP_IDX_BYTES:], 'big')}"
