"""Pages in this process's memory, as a synchronous engine hands them to a PageStore:
each page two segments (an engine's K and V halves), filled with bytes derived from a
name so that a load can be checked against what was stored."""

from __future__ import annotations

import ctypes
import hashlib

from kvtier.hosts import Segment

#: Two segments per page, as an engine's K and V halves may come.
HALF = 6000
PAGE_BYTES = 2 * HALF


class Pages:
    """Page buffers in this process's memory, with their segments."""

    def __init__(self, count: int) -> None:
        self.buffers = [ctypes.create_string_buffer(PAGE_BYTES) for _ in range(count)]

    def segments(self) -> list[list[Segment]]:
        return [
            [(ctypes.addressof(buf), HALF), (ctypes.addressof(buf) + HALF, HALF)]
            for buf in self.buffers
        ]

    def fill(self, names: list[str]) -> None:
        for buf, name in zip(self.buffers, names, strict=True):
            ctypes.memmove(buf, contents(name), PAGE_BYTES)

    def holds(self, names: list[str]) -> list[bool]:
        return [buf.raw == contents(name) for buf, name in zip(self.buffers, names, strict=True)]


def contents(name: str) -> bytes:
    """The bytes of the page called ``name``."""
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (PAGE_BYTES // len(seed) + 1))[:PAGE_BYTES]
