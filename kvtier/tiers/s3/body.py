"""Request and response bodies of the s3 tier, as views of the primary row.

An upload's body is the chunk header and the pinned primary row themselves, never
joined into one copy (:class:`RequestBody`); a multipart upload's parts are slices of
the same row (:func:`split_parts`); a download is read straight into its slot
(:func:`fill`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["RequestBody", "fill", "split_parts"]


class RequestBody:
    """A request body sent from memoryviews as they are, never joined into one copy.

    aiohttp streams it through ``__aiter__``. botocore accepts it as a file-like body
    because it has ``read``, which it also uses (with ``seek``/``tell``) to hash the
    payload when ``sign_payload`` is on.
    """

    __slots__ = ("_parts", "_position", "_size")

    def __init__(self, parts: Sequence[memoryview]) -> None:
        self._parts = tuple(parts)
        self._size = sum(len(part) for part in self._parts)
        self._position = 0

    def __len__(self) -> int:
        return self._size

    def __aiter__(self) -> _PartIterator:
        return _PartIterator(self._parts)

    def read(self, size: int = -1) -> bytes:
        start = self._position
        end = self._size if size is None or size < 0 else min(self._size, start + size)
        out = bytearray()
        offset = 0
        for part in self._parts:
            part_end = offset + len(part)
            if part_end > start and offset < end:
                out += part[max(start, offset) - offset : min(end, part_end) - offset]
            offset = part_end
        self._position = end if end > start else start
        return bytes(out)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: self._size}[whence]
        self._position = max(0, min(self._size, base + offset))
        return self._position

    def tell(self) -> int:
        return self._position


class _PartIterator:
    __slots__ = ("_parts",)

    def __init__(self, parts: tuple[memoryview, ...]) -> None:
        self._parts = list(reversed(parts))

    def __aiter__(self) -> _PartIterator:
        return self

    async def __anext__(self) -> memoryview:
        if not self._parts:
            raise StopAsyncIteration
        return self._parts.pop()


def split_parts(header: memoryview, row: memoryview, part_bytes: int) -> list[list[memoryview]]:
    """The multipart parts of header + row: views of ``part_bytes`` (the last shorter)."""
    first = part_bytes - len(header)
    rest = [[row[start : start + part_bytes]] for start in range(first, len(row), part_bytes)]
    return [[header, row[:first]], *rest]


async def fill(body: Any, target: memoryview) -> int:
    """Read from a response body into ``target`` until it is full or the body ends."""
    filled = 0
    while filled < len(target):
        # read(n) hands over what the connection has buffered, up to n bytes: a
        # transient piece, copied into place at once.
        piece = await body.read(len(target) - filled)
        if not piece:
            break
        target[filled : filled + len(piece)] = piece
        filled += len(piece)
    return filled
