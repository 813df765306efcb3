"""Framing: every frame is an 8-byte big-endian unsigned length, then that many bytes of body."""

from __future__ import annotations

import struct

PREFIX_BYTES = 8
DEFAULT_CHUNK_BYTES = 1 << 20

_PREFIX = struct.Struct(">Q")


def frame_prefix(length: int) -> bytes:
    return _PREFIX.pack(length)


def read_prefix(prefix: bytes | bytearray | memoryview) -> int:
    """The length a frame's prefix declares."""
    length: int = _PREFIX.unpack(prefix)[0]
    return length
