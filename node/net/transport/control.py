"""The framed, versioned protocol between a node and its py-libp2p child process (see libp2p_child.py).

Shared by both sides, so it imports neither hivemind nor libp2p (stdlib and msgspec only). A frame is
a 4-byte big-endian length and a msgpack map with `v` (this protocol's version) and `op`; each op has
a declared schema here (a msgspec Struct), and every frame is checked against it before use. Three
kinds of local connection:

- the control channel (a socketpair the node creates): the child says `ready`; the node sends
  `connect`/`serve`/`stop` requests with an `id`, the child answers each with a `result`; the child
  also sends `state` whenever its relay state changes (the circuits it holds, the peers it reaches
  only through a relay);
- an outgoing stream: the node connects to the child's stream socket, sends `open`, gets `opened`
  or `error`, and from then on the connection carries the libp2p stream's bytes both ways;
- an incoming stream: the child connects to the node's stream socket and sends `incoming`; then bytes.

A half-close (shutdown of the writing side) on a local connection is the stream's end of data; an
abrupt close is a reset.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import msgspec

VERSION = 1
MAX_FRAME_BYTES = 64 * 1024
_LENGTH = struct.Struct(">I")
LENGTH_BYTES = _LENGTH.size
_MAX_TEXT = 1024
_MAX_LIST = 64

Text = Annotated[str, msgspec.Meta(max_length=_MAX_TEXT)]
Texts = Annotated[tuple[Text, ...], msgspec.Meta(max_length=_MAX_LIST)]


class Op(enum.StrEnum):
    READY = "ready"
    CONNECT = "connect"
    SERVE = "serve"
    STOP = "stop"
    RESULT = "result"
    OPEN = "open"
    OPENED = "opened"
    ERROR = "error"
    INCOMING = "incoming"
    STATE = "state"


class ControlError(ValueError):
    """A control frame is malformed, too large, of another version, or not the op expected."""


class Frame(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A checked control frame; each op is a subclass whose fields follow `v` and `op` on the wire."""

    v: int = VERSION
    op: str


class Ready(Frame, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: Literal["ready"] = "ready"
    peer_id: Text
    maddrs: Texts


class Connect(Frame, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: Literal["connect"] = "connect"
    id: int
    peer: Text
    maddrs: Texts
    timeout: float


class Serve(Frame, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: Literal["serve"] = "serve"
    id: int
    protocol: Text


class Stop(Frame, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: Literal["stop"] = "stop"


class Result(Frame, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: Literal["result"] = "result"
    id: int
    ok: bool
    error: Text


class Open(Frame, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: Literal["open"] = "open"
    peer: Text
    protocol: Text
    timeout: float


class Opened(Frame, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: Literal["opened"] = "opened"
    peer: Text


class Error(Frame, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: Literal["error"] = "error"
    error: Text


class Incoming(Frame, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: Literal["incoming"] = "incoming"
    peer: Text
    protocol: Text


class State(Frame, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: Literal["state"] = "state"
    circuits: Texts  # full /p2p-circuit multiaddrs of this host through the relays holding a slot for it
    relayed: Texts  # peers this host is connected to only through a relay


_SCHEMAS: Mapping[str, type[Frame]] = {
    Op.READY: Ready, Op.CONNECT: Connect, Op.SERVE: Serve, Op.STOP: Stop, Op.RESULT: Result,
    Op.OPEN: Open, Op.OPENED: Opened, Op.ERROR: Error, Op.INCOMING: Incoming, Op.STATE: State,
}
_DECODERS = {op: msgspec.msgpack.Decoder(schema) for op, schema in _SCHEMAS.items()}
# Any map: `v` and `op` are read first, so a frame of another version or op is named as such.
_HEAD = msgspec.msgpack.Decoder(dict[str, Any])
_ENCODER = msgspec.msgpack.Encoder()


def encode(op: str, **fields: Any) -> bytes:
    """One frame, length prefix included; checks it against the schema first, like the reader will."""
    body = _ENCODER.encode({"v": VERSION, "op": op, **fields})
    decode_body(body)
    return _LENGTH.pack(len(body)) + body


def frame_length(prefix: bytes) -> int:
    """The body length a 4-byte prefix announces; ControlError if it exceeds MAX_FRAME_BYTES."""
    length: int = _LENGTH.unpack(prefix)[0]
    if length > MAX_FRAME_BYTES:
        raise ControlError(f"control frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return length


def decode_body(body: bytes, expect: Sequence[str] | None = None) -> Frame:
    """Parse and validate one frame body; `expect` limits which ops are acceptable here."""
    try:
        value = _HEAD.decode(body)
    except msgspec.ValidationError:
        raise ControlError("control frame is not a map") from None
    except msgspec.DecodeError as exc:
        raise ControlError(f"control frame is not msgpack: {exc}") from None
    version = value.get("v")
    if version != VERSION:
        raise ControlError(f"control protocol version {version!r}; this side speaks {VERSION}")
    op = value.get("op")
    if not isinstance(op, str) or op not in _SCHEMAS:
        raise ControlError(f"unknown control op {op!r}")
    if expect is not None and op not in expect:
        raise ControlError(f"expected {' or '.join(expect)}, got {op!r}")
    try:
        return _DECODERS[op].decode(body)
    except msgspec.ValidationError as exc:
        raise ControlError(f"control op {op!r}: {_explain(_SCHEMAS[op], value, exc)}") from None


def _explain(schema: type[Frame], value: Mapping[str, Any], exc: msgspec.ValidationError) -> str:
    """Which declared field the frame breaks, found by converting each field on its own (the slow
    path: only for a frame already refused)."""
    for field in msgspec.structs.fields(schema):
        if field.name in ("v", "op"):
            continue
        try:
            msgspec.convert(value[field.name], field.type, strict=True)
        except (KeyError, msgspec.ValidationError):
            return f"field {field.name!r} missing or not {_describe(msgspec.inspect.type_info(field.type))}"
    return str(exc)  # every field is well-formed: an unknown field


def _describe(info: msgspec.inspect.Type) -> str:
    if isinstance(info, msgspec.inspect.StrType):
        return f"str of at most {info.max_length} characters"
    if isinstance(info, msgspec.inspect.VarTupleType):
        return f"a list of at most {info.max_length} {_describe(info.item_type)}s"
    return {msgspec.inspect.BoolType: "bool", msgspec.inspect.IntType: "int",
            msgspec.inspect.FloatType: "int or float"}.get(type(info), type(info).__name__)
