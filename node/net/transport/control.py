"""The framed, versioned protocol between a node and its py-libp2p child process (see libp2p_child.py).

Shared by both sides, so it imports neither hivemind nor libp2p (stdlib and msgpack only). A frame is
a 4-byte big-endian length and a msgpack map with `v` (this protocol's version) and `op`; each op has
a schema here, and every frame is checked against it before use. Three kinds of local connection:

- the control channel (a socketpair the node creates): the child says `ready`; the node sends
  `connect`/`serve`/`stop` requests with an `id`, the child answers each with a `result`;
- an outgoing stream: the node connects to the child's stream socket, sends `open`, gets `opened`
  or `error`, and from then on the connection carries the libp2p stream's bytes both ways;
- an incoming stream: the child connects to the node's stream socket and sends `incoming`; then bytes.

A half-close (shutdown of the writing side) on a local connection is the stream's end of data; an
abrupt close is a reset.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

VERSION = 1
MAX_FRAME_BYTES = 64 * 1024
_LENGTH = struct.Struct(">I")
LENGTH_BYTES = _LENGTH.size

# op -> required fields and their types (beyond `v` and `op`)
_SCHEMAS: Mapping[str, Mapping[str, type | tuple[type, ...]]] = {
    "ready": {"peer_id": str, "maddrs": list},
    "connect": {"id": int, "peer": str, "maddrs": list, "timeout": (int, float)},
    "serve": {"id": int, "protocol": str},
    "stop": {},
    "result": {"id": int, "ok": bool, "error": str},
    "open": {"peer": str, "protocol": str, "timeout": (int, float)},
    "opened": {"peer": str},
    "error": {"error": str},
    "incoming": {"peer": str, "protocol": str},
}
_MAX_TEXT = 1024
_MAX_LIST = 64


class ControlError(ValueError):
    """A control frame is malformed, too large, of another version, or not the op expected."""


@dataclass(frozen=True)
class Frame:
    op: str
    fields: Mapping[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]


def encode(op: str, **fields: Any) -> bytes:
    """One frame, length prefix included; checks it against the schema first, like the reader will."""
    body = msgpack.packb({"v": VERSION, "op": op, **fields}, use_bin_type=True)
    decode_body(body)
    return _LENGTH.pack(len(body)) + body


def frame_length(prefix: bytes) -> int:
    """The body length a 4-byte prefix announces; ControlError if it exceeds MAX_FRAME_BYTES."""
    (length,) = _LENGTH.unpack(prefix)
    if length > MAX_FRAME_BYTES:
        raise ControlError(f"control frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return length


def decode_body(body: bytes, expect: tuple[str, ...] | None = None) -> Frame:
    """Parse and validate one frame body; `expect` limits which ops are acceptable here."""
    try:
        value = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ControlError(f"control frame is not msgpack: {exc}") from None
    if not isinstance(value, dict):
        raise ControlError("control frame is not a map")
    version = value.get("v")
    if version != VERSION:
        raise ControlError(f"control protocol version {version!r}; this side speaks {VERSION}")
    op = value.get("op")
    schema = _SCHEMAS.get(op) if isinstance(op, str) else None
    if schema is None:
        raise ControlError(f"unknown control op {op!r}")
    if expect is not None and op not in expect:
        raise ControlError(f"expected {' or '.join(expect)}, got {op!r}")
    fields = {}
    for name, kind in schema.items():
        item = value.get(name)
        if not isinstance(item, kind) or (isinstance(item, bool) and kind is not bool):
            raise ControlError(f"control op {op!r}: field {name!r} missing or not {_kind_name(kind)}")
        if isinstance(item, str) and len(item) > _MAX_TEXT:
            raise ControlError(f"control op {op!r}: field {name!r} longer than {_MAX_TEXT}")
        if isinstance(item, list):
            if len(item) > _MAX_LIST or not all(isinstance(x, str) and len(x) <= _MAX_TEXT for x in item):
                raise ControlError(f"control op {op!r}: field {name!r} must be at most {_MAX_LIST} strings")
        fields[name] = item
    return Frame(op, fields)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)
