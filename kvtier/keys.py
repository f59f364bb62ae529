"""Offload keys: the name of one offloaded chunk.

A key is the raw bytes of a block hash followed by the 4-byte big-endian index of the
KV-cache group the block belongs to. This is the encoding vLLM uses, so keys computed
by either system name the same chunk. Keys are plain ``bytes`` (no tuple or object per
key), which keeps the scheduler's hot dictionaries small and fast.

A host that is not vLLM names its chunks with :func:`prefix_keys`: chained hashes
over the token ids of a prompt, so a chunk's key stands for the whole prefix up to
and including that chunk.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Sequence
from typing import NewType

__all__ = [
    "GROUP_IDX_BYTES",
    "OffloadKey",
    "format_key",
    "key_block_hash",
    "key_group_idx",
    "make_offload_key",
    "prefix_keys",
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


#: Opens every hashed message, so a prefix key can never equal the hash of some other
#: kvtier or host structure; the version changes whenever the encoding below does.
_PREFIX_DOMAIN = b"kvtier.prefix_keys/v1\x00"
_LENGTH = struct.Struct(">Q")
_MAX_TOKEN = (1 << 64) - 1


def prefix_keys(
    token_ids: Sequence[int],
    chunk_tokens: int,
    *,
    salt: bytes | str = b"",
    parent: OffloadKey | None = None,
    extra: bytes | str | None = None,
    group_idx: int = 0,
) -> list[OffloadKey]:
    """The keys of the full chunks of ``token_ids``, each one naming its whole prefix.

    ``token_ids`` is cut into chunks of ``chunk_tokens`` tokens (the config's
    ``block_size``); a partial last chunk gets no key, since it cannot be stored. The
    block hash of chunk ``i`` is the SHA-256 of a canonical byte encoding of the
    previous chunk's block hash (``parent``'s for the first chunk, none without one),
    ``salt``, ``extra`` and the chunk's token ids, so two prompts share exactly the keys
    of the chunks they share from their first token on, and one changed token changes
    the key of its chunk and of every chunk after it. Each key is
    ``make_offload_key(block_hash, group_idx)``.

    The keys depend on nothing but these arguments: not on the process, the machine,
    the Python version or ``PYTHONHASHSEED``, so processes and nodes sharing a tier
    agree on them.

    Args:
        token_ids: the prompt's token ids (ints, or an integer tensor or array).
        chunk_tokens: tokens per chunk, ``block_size`` in the config.
        salt: the cache identity: everything that changes the KV values of the same
            tokens, i.e. the model and its revision, the weights' quantization, the KV
            dtype, a tenant that must not share. Different salts share no key.
        parent: the key of the chunk just before ``token_ids``, to continue a chain:
            ``prefix_keys(a + b, n)`` equals ``prefix_keys(a, n) + prefix_keys(b, n,
            parent=prefix_keys(a, n)[-1])`` when ``len(a)`` is a multiple of ``n``.
            Only its block hash counts, not its group index.
        extra: what else these chunks' KV depends on, such as a LoRA adapter's name or
            the hash of an image in them; it goes into every chunk of this call (call
            again with ``parent`` for chunks with other extras). ``None`` and ``b""``
            are the same.
        group_idx: the KV-cache group of the keys.

    When looking up a prompt before computing it, pass all its tokens but the last:
    the model must compute at least one token to produce the next one.

    Raises:
        TypeError: a token id is not an integer, or ``salt`` / ``extra`` are neither
            bytes nor str.
        ValueError: ``chunk_tokens`` < 1, a token id is negative or above 2**64 - 1,
            ``parent`` is not a key, or ``group_idx`` does not fit in 4 bytes.
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int):
        raise TypeError(f"chunk_tokens must be an int, not {type(chunk_tokens).__name__}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not 0 <= group_idx <= _MAX_GROUP_IDX:
        raise ValueError(f"group_idx must be in [0, {_MAX_GROUP_IDX}], got {group_idx}")
    if parent is not None and not isinstance(parent, bytes):
        raise TypeError(f"parent must be an OffloadKey (bytes), not {type(parent).__name__}")
    tokens = _token_list(token_ids)
    fixed = _length_prefixed(_as_bytes("salt", salt)) + _length_prefixed(
        b"" if extra is None else _as_bytes("extra", extra)
    )
    previous = b"" if parent is None else key_block_hash(parent)
    chunk_format = struct.Struct(f">{chunk_tokens}Q")
    keys: list[OffloadKey] = []
    for start in range(0, len(tokens) - chunk_tokens + 1, chunk_tokens):
        message = b"".join(
            (
                _PREFIX_DOMAIN,
                _length_prefixed(previous),
                fixed,
                _LENGTH.pack(chunk_tokens),
                chunk_format.pack(*tokens[start : start + chunk_tokens]),
            )
        )
        previous = hashlib.sha256(message).digest()
        keys.append(make_offload_key(previous, group_idx))
    return keys


def _token_list(token_ids: Sequence[int]) -> list[int]:
    # Tensors and arrays turn into Python ints in one call instead of one per element.
    tolist = getattr(token_ids, "tolist", None)
    tokens = tolist() if callable(tolist) else list(token_ids)
    if not isinstance(tokens, list):
        raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    for position, token in enumerate(tokens):
        if type(token) is not int:
            try:
                if isinstance(token, bool):
                    raise TypeError
                tokens[position] = token = operator.index(token)
            except TypeError:
                raise TypeError(
                    f"token_ids[{position}] is {token!r} ({type(token).__name__}); "
                    "token ids must be ints"
                ) from None
        if not 0 <= token <= _MAX_TOKEN:
            raise ValueError(f"token_ids[{position}] is {token}; token ids must be in [0, 2**64)")
    return tokens


def _as_bytes(name: str, value: bytes | str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{name} must be bytes or str, not {type(value).__name__}")


def _length_prefixed(data: bytes) -> bytes:
    return _LENGTH.pack(len(data)) + data
