"""The murmur wire format (protocol `/murmur/gossip/1`): framing, header schema, validation, chunked payload.

Frames
    Every frame is an 8-byte big-endian unsigned length N followed by N bytes of body.

Message
    One header frame, then payload chunk frames::

        [N_h][header: msgpack map, N_h bytes]  [N_1][chunk 1] ... [N_m][chunk m]

    The payload is the encoded tensors concatenated in manifest order, cut into chunks of at most
    `chunk_bytes` (default 1 MiB; every chunk but the last is full when `encode_message` writes it,
    but a receiver accepts any sizes). Chunk bodies are raw bytes, not msgpack. The chunk lengths
    must add up exactly to the sum of the manifest's byte lengths; a message whose tensors encode
    to zero bytes has no chunk frames. Nothing follows the last chunk within the message.

Header (a msgpack map with exactly these keys; any other key is a schema error)
    ``v``           int, protocol version, 1
    ``swarm``       str, swarm name
    ``config_hash`` str, hash of the swarm's training config
    ``sender``      str, sender's peer id
    ``round``       int >= 0
    ``step``        int >= 0
    ``kind``        str, what the message is for, e.g. "exchange", "reply", "params"
    ``codec``       str, one of fp32, fp16, bf16, int8, topk (see `gossip.codecs` for layouts)
    ``codec_opts``  map str -> int/float, e.g. {"block": 256} or {"ratio": 0.01}; {} for none
    ``manifest``    list of [name: str, dtype: "float32"|"float16"|"float64", shape: list of int >= 0,
                    nbytes: int, the tensor's encoded length on the wire]
    ``meta``        map str -> None/bool/int/float/str, for extensions (bounded by `WireLimits`)
    Strings are UTF-8, non-empty and at most `max_name_len` bytes; ints are below 2^63; map keys
    are unique. Tensor names are unique. Decoded tensors come back in the manifest's dtype and shape.

Validation (receiver), in this order, each failure its own `gossip.errors` exception:
    1. header length prefix against `max_header_bytes` before reading the body (FrameTooLarge);
    2. msgpack with per-container limits, so a declared array of 10^9 items is refused without
       allocating (FrameTooLarge), malformed bytes or duplicate keys (BadSchema);
    3. version (VersionMismatch), then keys, types and ranges (BadSchema; a `WireLimits` bound,
       such as too many tensors, dims or meta entries or too long a name: FrameTooLarge);
    4. codec known (UnknownCodec) and its options valid (BadSchema);
    5. manifest: every entry's nbytes is what the codec needs for its shape (ManifestMismatch),
       total payload <= `max_payload_bytes` and decoded size <= `max_decoded_bytes` (FrameTooLarge);
    6. against the receiver's `Expectation`, if any: swarm and config hash (WrongSwarm), codec
       allowed (UnknownCodec), manifest equal to the local model's names, dtypes, shapes
       (ManifestMismatch);
    7. each chunk length: non-zero (BadSchema), <= `max_chunk_bytes` (FrameTooLarge), <= what the
       manifest has left (ManifestMismatch);
    8. each tensor as soon as its bytes are in: codec layout (BadSchema) and finite values
       (NonFiniteValues). A stream or buffer that ends early raises Truncated; bytes after the
       message (in `decode_message`) are BadSchema.
    The decoder allocates only in proportion to bytes actually received, never from a declared
    length alone: an fp32/fp16/bf16 tensor's output array is allocated once an eighth of its bytes
    have arrived (so at most 8x the decoded size of what was received) and then filled chunk by
    chunk as the bytes arrive; int8 and top-k tensors are kept as received and decoded once
    complete. The one other amplification is a decoded tensor (a top-k tensor of n elements arrives
    in as little as 8 bytes), bounded by `max_decoded_bytes`. A node passes an `Expectation` with
    its model's manifest, which fixes every size before any payload is read.
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, NamedTuple

import msgpack
import numpy as np

from gossip.codecs import WIRE_DTYPES, Codec, ElementwiseCodec, codec_from_wire, dtype_name
from gossip.errors import (
    BadSchema,
    FrameTooLarge,
    ManifestMismatch,
    Truncated,
    UnknownCodec,
    VersionMismatch,
    WireError,
    WrongSwarm,
)

PROTOCOL_VERSION = 1
PREFIX_BYTES = 8
DEFAULT_CHUNK_BYTES = 1 << 20
HEADER_KEYS = (
    "v", "swarm", "config_hash", "sender", "round", "step", "kind", "codec", "codec_opts", "manifest", "meta",
)  # fmt: skip

_PREFIX = struct.Struct(">Q")
_MAX_INT = (1 << 63) - 1
_ZERO_COPY_MIN = 64 << 10  # chunks at least this large go out as a view of the encoded tensor, not a copy
# A tensor's output array is allocated once 1/_ALLOCATE_AFTER of its bytes have arrived, never on a
# declared size alone: the decoder holds at most that many times the decoded size of what it received.
_ALLOCATE_AFTER = 8
_DECODE_MIN = 64 << 10  # smaller pieces of a tensor are decoded together, once this much has arrived
_OFFLOAD_BYTES = 1 << 20  # read_message hands payload to a worker thread in batches of at least this much

MetaValue = None | bool | int | float | str


@dataclass(frozen=True)
class WireLimits:
    """Bounds a receiver enforces before allocating anything; both ends should use the same ones."""

    max_header_bytes: int = 1 << 20
    max_tensors: int = 65536
    max_ndim: int = 8
    max_chunk_bytes: int = 4 << 20
    max_payload_bytes: int = 4 << 30
    max_decoded_bytes: int = 4 << 30  # decoded tensors in their manifest dtypes, all together
    max_name_len: int = 256  # every string in the header, in UTF-8 bytes
    max_meta_entries: int = 64


DEFAULT_LIMITS = WireLimits()


class TensorSpec(NamedTuple):
    """What a tensor is, without its values: name, wire dtype name, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ManifestEntry:
    """One tensor in a header: its spec and its encoded length on the wire."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)


@dataclass(frozen=True)
class Header:
    """A message header, as sent and as validated on receipt."""

    swarm: str
    config_hash: str
    sender: str
    round: int
    step: int
    kind: str
    codec: str
    codec_opts: Mapping[str, int | float]
    manifest: tuple[ManifestEntry, ...]
    meta: Mapping[str, MetaValue] = field(default_factory=lambda: MappingProxyType({}))
    version: int = PROTOCOL_VERSION

    @property
    def payload_nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.manifest)

    def to_wire(self) -> dict[str, Any]:
        """The msgpack map, keys in `HEADER_KEYS` order."""
        return {
            "v": self.version,
            "swarm": self.swarm,
            "config_hash": self.config_hash,
            "sender": self.sender,
            "round": self.round,
            "step": self.step,
            "kind": self.kind,
            "codec": self.codec,
            "codec_opts": dict(self.codec_opts),
            "manifest": [[e.name, e.dtype, list(e.shape), e.nbytes] for e in self.manifest],
            "meta": dict(self.meta),
        }


@dataclass(frozen=True)
class Expectation:
    """What a receiver accepts: its swarm and config, optionally its model's exact manifest and codecs."""

    swarm: str
    config_hash: str
    manifest: tuple[TensorSpec, ...] | None = None  # None: any manifest within the limits
    allowed_codecs: frozenset[str] | None = None  # None: any known codec

    def __post_init__(self) -> None:
        if self.manifest is not None:
            specs = tuple(TensorSpec(n, dtype_name(d), tuple(int(s) for s in shape)) for n, d, shape in self.manifest)
            object.__setattr__(self, "manifest", specs)
        if self.allowed_codecs is not None:
            object.__setattr__(self, "allowed_codecs", frozenset(self.allowed_codecs))

    @classmethod
    def for_tensors(
        cls,
        swarm: str,
        config_hash: str,
        tensors: Mapping[str, np.ndarray],
        allowed_codecs: Iterable[str] | None = None,
    ) -> Expectation:
        """Accept exactly the names, dtypes and shapes of `tensors` (the local model), in order."""
        codecs = None if allowed_codecs is None else frozenset(allowed_codecs)
        return cls(swarm, config_hash, tensor_specs(tensors), codecs)


@dataclass(frozen=True)
class Message:
    """A decoded message: its header and its tensors (fresh arrays, in manifest order)."""

    header: Header
    tensors: dict[str, np.ndarray]


def tensor_specs(tensors: Mapping[str, np.ndarray]) -> tuple[TensorSpec, ...]:
    """Name, dtype and shape of each tensor, in order; TypeError for a dtype the wire does not carry."""
    specs = []
    for name, tensor in tensors.items():
        if not isinstance(tensor, np.ndarray | np.generic):
            raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a numpy array")
        specs.append(TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape)))
    return tuple(specs)


def _frame_prefix(length: int) -> bytes:
    return _PREFIX.pack(length)


def _make_header(
    specs: Iterable[TensorSpec],
    codec: Codec,
    *,
    swarm: str,
    config_hash: str,
    sender: str,
    round: int,
    step: int,
    kind: str,
    meta: Mapping[str, MetaValue] | None,
) -> Header:
    manifest = tuple(
        ManifestEntry(name, dtype, tuple(int(s) for s in shape), codec.encoded_nbytes(math.prod(shape)))
        for name, dtype, shape in specs
    )
    return Header(
        swarm=swarm,
        config_hash=config_hash,
        sender=sender,
        round=round,
        step=step,
        kind=kind,
        codec=codec.name,
        codec_opts=MappingProxyType(dict(codec.options())),
        manifest=manifest,
        meta=MappingProxyType(dict(meta or {})),
    )


def _pack(header: Header) -> bytes:
    return msgpack.packb(header.to_wire(), use_bin_type=True)


# ---------------------------------------------------------------------------------------------
# header parsing


class _DuplicateKey(ValueError):
    pass


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    mapping = dict(pairs)
    if len(mapping) != len(pairs):
        raise _DuplicateKey("a map repeats a key")
    return mapping


def _unpack(body: bytes | bytearray | memoryview, limits: WireLimits) -> Any:
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            use_list=True,
            strict_map_key=True,
            object_pairs_hook=_unique_map,
            max_str_len=limits.max_header_bytes,
            max_bin_len=limits.max_header_bytes,
            max_array_len=max(limits.max_tensors, limits.max_ndim, 4),
            max_map_len=max(limits.max_meta_entries, len(HEADER_KEYS)),
            max_ext_len=0,
        )
    except _DuplicateKey as exc:
        raise BadSchema(f"header: {exc}") from None
    except ValueError as exc:  # msgpack's errors (and UnicodeDecodeError) are all ValueErrors
        text = str(exc)
        if "exceeds max_" in text and "max_ext_len" not in text:
            raise FrameTooLarge(f"header: {text}") from None
        raise BadSchema(f"header is not a valid msgpack map: {text or type(exc).__name__}") from None


def _check_str(value: object, what: str, limits: WireLimits, *, allow_empty: bool = False) -> str:
    if type(value) is not str:
        raise BadSchema(f"{what} must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise BadSchema(f"{what} is empty")
    size = len(value.encode())
    if size > limits.max_name_len:
        raise FrameTooLarge(f"{what} is {size} bytes long, over max_name_len ({limits.max_name_len})")
    return value


def _check_uint(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= _MAX_INT:
        raise BadSchema(f"{what} must be an integer in [0, 2^63), got {value!r}")
    return value


def _check_map(value: object, what: str) -> dict[Any, Any]:
    if type(value) is not dict:
        raise BadSchema(f"{what} must be a map, got {type(value).__name__}")
    return value


def _parse_codec(obj: dict[str, Any], limits: WireLimits) -> Codec:
    name = _check_str(obj["codec"], "header 'codec'", limits)
    opts = _check_map(obj["codec_opts"], "header 'codec_opts'")
    for key, value in opts.items():
        _check_str(key, "a codec_opts key", limits)
        if type(value) not in (int, float):
            raise BadSchema(f"codec option {key!r} must be a number, got {type(value).__name__}")
    return codec_from_wire(name, opts)


def _parse_manifest(raw: object, codec: Codec, limits: WireLimits) -> tuple[ManifestEntry, ...]:
    if type(raw) is not list:
        raise BadSchema(f"header 'manifest' must be a list, got {type(raw).__name__}")
    if len(raw) > limits.max_tensors:
        raise FrameTooLarge(f"manifest has {len(raw)} tensors, over max_tensors ({limits.max_tensors})")
    entries: list[ManifestEntry] = []
    names: set[str] = set()
    payload = decoded = 0
    for i, item in enumerate(raw):
        if type(item) is not list or len(item) != 4:
            raise BadSchema(f"manifest entry {i} must be [name, dtype, shape, nbytes]")
        name = _check_str(item[0], f"manifest entry {i} name", limits)
        where = f"manifest entry {i} {name!r}"
        if name in names:
            raise BadSchema(f"{where}: name appears twice")
        names.add(name)
        dtype = item[1]
        if type(dtype) is not str or dtype not in WIRE_DTYPES:
            raise BadSchema(f"{where}: dtype {dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
        shape = item[2]
        if type(shape) is not list:
            raise BadSchema(f"{where}: shape must be a list of integers")
        if len(shape) > limits.max_ndim:
            raise FrameTooLarge(f"{where}: {len(shape)} dimensions, over max_ndim ({limits.max_ndim})")
        for dim in shape:
            _check_uint(dim, f"{where}: a dimension")
        nbytes = _check_uint(item[3], f"{where}: nbytes")
        numel = math.prod(shape)
        if not codec.accepts_nbytes(numel, nbytes):
            raise ManifestMismatch(
                f"{where}: {nbytes} bytes on the wire, but {codec.name} encodes {numel} elements "
                f"in {codec.encoded_nbytes(numel)} bytes"
            )
        payload += nbytes
        decoded += numel * WIRE_DTYPES[dtype].itemsize
        if payload > limits.max_payload_bytes:
            raise FrameTooLarge(
                f"manifest declares at least {payload} payload bytes, "
                f"over max_payload_bytes ({limits.max_payload_bytes})"
            )
        if decoded > limits.max_decoded_bytes:
            raise FrameTooLarge(
                f"tensors decode to at least {decoded} bytes, over max_decoded_bytes ({limits.max_decoded_bytes})"
            )
        entries.append(ManifestEntry(name, dtype, tuple(shape), nbytes))
    return tuple(entries)


def _parse_meta(raw: object, limits: WireLimits) -> dict[str, MetaValue]:
    meta = _check_map(raw, "header 'meta'")
    if len(meta) > limits.max_meta_entries:
        raise FrameTooLarge(f"meta has {len(meta)} entries, over max_meta_entries ({limits.max_meta_entries})")
    for key, value in meta.items():
        _check_str(key, "a meta key", limits)
        if type(value) is str:
            _check_str(value, f"meta {key!r}", limits, allow_empty=True)
        elif value is not None and type(value) not in (bool, int, float):
            raise BadSchema(f"meta {key!r} must be None, bool, int, float or str, got {type(value).__name__}")
    return meta


def parse_header(body: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS) -> tuple[Header, Codec]:
    """Validate a header frame's body (steps 2-5 of the module docstring); returns it and its codec."""
    obj = _unpack(body, limits)
    if type(obj) is not dict:
        raise BadSchema(f"header must be a msgpack map, got {type(obj).__name__}")
    version = obj.get("v")
    if type(version) is not int:
        raise BadSchema("header has no integer 'v' (protocol version)")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(f"protocol version {version}, this node speaks {PROTOCOL_VERSION}")
    missing = [key for key in HEADER_KEYS if key not in obj]
    if missing:
        raise BadSchema(f"header is missing {', '.join(missing)}")
    unknown = sorted(repr(key) for key in obj if key not in HEADER_KEYS)
    if unknown:
        raise BadSchema(f"header has unknown keys {', '.join(unknown)}")
    strings = {
        key: _check_str(obj[key], f"header {key!r}", limits) for key in ("swarm", "config_hash", "sender", "kind")
    }
    round_ = _check_uint(obj["round"], "header 'round'")
    step = _check_uint(obj["step"], "header 'step'")
    meta = _parse_meta(obj["meta"], limits)
    codec = _parse_codec(obj, limits)
    manifest = _parse_manifest(obj["manifest"], codec, limits)
    header = Header(
        swarm=strings["swarm"],
        config_hash=strings["config_hash"],
        sender=strings["sender"],
        round=round_,
        step=step,
        kind=strings["kind"],
        codec=codec.name,
        codec_opts=MappingProxyType(dict(obj["codec_opts"])),
        manifest=manifest,
        meta=MappingProxyType(meta),
        version=version,
    )
    return header, codec


def check_expectation(header: Header, expected: Expectation) -> None:
    """Step 6: WrongSwarm, UnknownCodec or ManifestMismatch if `header` is not what the receiver accepts."""
    if header.swarm != expected.swarm:
        raise WrongSwarm(f"swarm {header.swarm!r}, expected {expected.swarm!r}")
    if header.config_hash != expected.config_hash:
        raise WrongSwarm(f"config hash {header.config_hash!r}, expected {expected.config_hash!r}")
    if expected.allowed_codecs is not None and header.codec not in expected.allowed_codecs:
        allowed = ", ".join(sorted(expected.allowed_codecs))
        raise UnknownCodec(f"codec {header.codec!r} is not accepted here (allowed: {allowed})")
    if expected.manifest is None:
        return
    for i, (got, want) in enumerate(zip(header.manifest, expected.manifest)):
        where = f"manifest entry {i} {got.name!r}"
        if got.name != want.name:
            raise ManifestMismatch(f"manifest entry {i}: name {got.name!r} != expected {want.name!r}")
        if got.dtype != want.dtype:
            raise ManifestMismatch(f"{where}: dtype {got.dtype} != expected {want.dtype}")
        if got.shape != want.shape:
            raise ManifestMismatch(f"{where}: shape {list(got.shape)} != expected {list(want.shape)}")
    if len(header.manifest) != len(expected.manifest):
        raise ManifestMismatch(f"manifest has {len(header.manifest)} tensors, expected {len(expected.manifest)}")


# ---------------------------------------------------------------------------------------------
# encoding


def _check_chunk_bytes(chunk_bytes: int, limits: WireLimits) -> None:
    if not 1 <= chunk_bytes <= limits.max_chunk_bytes:
        raise ValueError(f"chunk_bytes must be in [1, {limits.max_chunk_bytes}], got {chunk_bytes}")


def _chunk_frames(payloads: Iterable[memoryview], chunk_bytes: int) -> Iterator[bytes | memoryview]:
    """Length-prefixed chunk frames of exactly `chunk_bytes` (the last may be shorter) over the
    concatenation of `payloads`, consumed lazily."""
    pending: list[memoryview] = []
    pending_len = 0

    def flush() -> list[bytes | memoryview]:
        nonlocal pending, pending_len
        prefix = _frame_prefix(pending_len)
        parts: list[bytes | memoryview]
        if len(pending) == 1 and pending_len >= _ZERO_COPY_MIN:
            parts = [prefix, pending[0]]
        else:
            parts = [b"".join([prefix, *pending])]
        pending, pending_len = [], 0
        return parts

    for payload in payloads:
        offset = 0
        while offset < len(payload):
            take = min(chunk_bytes - pending_len, len(payload) - offset)
            pending.append(payload[offset : offset + take])
            pending_len += take
            offset += take
            if pending_len == chunk_bytes:
                yield from flush()
    if pending_len:
        yield from flush()


def _encoded_payloads(tensors: Mapping[str, np.ndarray], codec: Codec, manifest: tuple[ManifestEntry, ...],
                      chunk_bytes: int) -> Iterator[memoryview]:
    """Each tensor's encoded bytes, in order. Elementwise codecs encode about one chunk's worth of
    elements at a time, when the frames reach it, so the first bytes leave before the last elements
    are checked and converted."""
    for (name, tensor), entry in zip(tensors.items(), manifest):
        pieces: list[tuple[str, np.ndarray]] = [("", tensor)]  # (where, what): the whole tensor at once
        if isinstance(codec, ElementwiseCodec) and tensor.size:
            flat, step = tensor.reshape(-1), max(1, chunk_bytes // codec.element_nbytes)
            if flat.size > step:
                pieces = [(f" elements {lo}-{min(flat.size, lo + step) - 1}", flat[lo : lo + step])
                          for lo in range(0, flat.size, step)]
        produced = 0
        for where, piece in pieces:
            try:
                encoded = codec.encode(piece)
            except WireError as exc:
                raise type(exc)(f"tensor {name!r}{where}: {exc}") from None
            produced += len(encoded)
            yield encoded
        if produced != entry.nbytes:
            raise RuntimeError(f"codec {codec.name} produced {produced} bytes for {name!r}, declared {entry.nbytes}")


def iter_message(
    tensors: Mapping[str, np.ndarray],
    codec: Codec,
    *,
    swarm: str,
    config_hash: str,
    sender: str,
    round: int,
    step: int,
    kind: str,
    meta: Mapping[str, MetaValue] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    limits: WireLimits = DEFAULT_LIMITS,
) -> Iterator[bytes | memoryview]:
    """The message's buffers, in order, encoded as they are asked for: a writer sends the first chunks
    while later ones are still being encoded. The header is checked before the first buffer is
    returned; a tensor's values are checked when its buffers are reached, so NonFiniteValues (or
    TypeError) can come after earlier buffers were taken. See `encode_message` for the rest."""
    _check_chunk_bytes(chunk_bytes, limits)
    header = _make_header(
        tensor_specs(tensors),
        codec,
        swarm=swarm,
        config_hash=config_hash,
        sender=sender,
        round=round,
        step=step,
        kind=kind,
        meta=meta,
    )
    body = _pack(header)
    if len(body) > limits.max_header_bytes:
        raise FrameTooLarge(f"header of {len(body)} bytes exceeds max_header_bytes ({limits.max_header_bytes})")
    parse_header(body, limits)  # refuse to send what a receiver would refuse
    return _message_buffers(_frame_prefix(len(body)) + body,
                            _chunk_frames(_encoded_payloads(tensors, codec, header.manifest, chunk_bytes), chunk_bytes))


def _message_buffers(head: bytes, frames: Iterator[bytes | memoryview]) -> Iterator[bytes | memoryview]:
    yield head
    yield from frames


def encode_message(
    tensors: Mapping[str, np.ndarray],
    codec: Codec,
    *,
    swarm: str,
    config_hash: str,
    sender: str,
    round: int,
    step: int,
    kind: str,
    meta: Mapping[str, MetaValue] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    limits: WireLimits = DEFAULT_LIMITS,
) -> list[bytes | memoryview]:
    """The message as buffers to write in order (their concatenation is the message).

    Large chunks are views of the encoded tensors (for fp32 and float32 tensors, of the tensors
    themselves): do not modify the tensors until the buffers are written. Raises what a receiver
    with the same `limits` would raise for this header (FrameTooLarge, BadSchema), NonFiniteValues
    for non-finite or unrepresentable values, TypeError for an unsupported dtype.
    """
    return list(iter_message(tensors, codec, swarm=swarm, config_hash=config_hash, sender=sender, round=round,
                             step=step, kind=kind, meta=meta, chunk_bytes=chunk_bytes, limits=limits))


def _specs_of(tensors: Mapping[str, np.ndarray | tuple[Iterable[int], Any]] | Iterable[TensorSpec]) -> list[TensorSpec]:
    if not isinstance(tensors, Mapping):
        return [TensorSpec(name, dtype_name(dtype), tuple(int(s) for s in shape)) for name, dtype, shape in tensors]
    specs = []
    for name, value in tensors.items():
        if isinstance(value, np.ndarray | np.generic):
            specs.append(TensorSpec(name, dtype_name(value.dtype), tuple(value.shape)))
        else:
            shape, dtype = value
            specs.append(TensorSpec(name, dtype_name(dtype), tuple(int(s) for s in shape)))
    return specs


def message_nbytes(
    tensors: Mapping[str, np.ndarray | tuple[Iterable[int], Any]] | Iterable[TensorSpec],
    codec: Codec,
    *,
    swarm: str = "murmur",
    config_hash: str = "0" * 64,
    sender: str = "12D3KooW" + "0" * 44,
    round: int = 0,
    step: int = 0,
    kind: str = "exchange",
    meta: Mapping[str, MetaValue] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> int:
    """Exact size on the wire of the message `encode_message` would produce, without encoding anything.

    `tensors` maps names to arrays or to (shape, dtype) pairs, or is a sequence of `TensorSpec`.
    The header fields default to a typical exchange header (a 64-character config hash, a
    52-character libp2p peer id, round and step 0); pass the real ones for the exact size of a
    real message. For top-k this is the size this encoder produces (k entries per tensor).
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    specs = _specs_of(tensors)
    header = _make_header(
        specs, codec, swarm=swarm, config_hash=config_hash, sender=sender, round=round, step=step, kind=kind, meta=meta
    )
    payload = header.payload_nbytes
    return PREFIX_BYTES + len(_pack(header)) + payload + PREFIX_BYTES * -(-payload // chunk_bytes)


# ---------------------------------------------------------------------------------------------
# decoding


class _Phase(Enum):
    HEADER_PREFIX = "header length prefix"
    HEADER = "header"
    CHUNK_PREFIX = "payload chunk length prefix"
    CHUNK = "payload chunk"
    DONE = "end of message"
    FAILED = "failed message"


# Called with (tensor name, index of the first element, the decoded and validated elements) as each
# run of a tensor arrives, in order, on whichever thread decodes; it must not raise. The values are
# a view of the message's tensor: a consumer copies what it keeps beyond the call.
ValuesSink = Callable[[str, int, np.ndarray], None]


class _JoinedEntry:
    """A tensor whose codec needs all of its bytes at once (int8, top-k): pieces kept, decoded at the end."""

    def __init__(self, codec: Codec, entry: ManifestEntry, on_values: ValuesSink | None = None) -> None:
        self._codec, self._entry, self._on_values = codec, entry, on_values
        self._pieces: list[bytes | memoryview] = []

    def write(self, piece: memoryview, keep: bool) -> None:
        self._pieces.append(piece if keep else bytes(piece))

    def finish(self) -> np.ndarray:
        pieces, self._pieces = self._pieces, []
        buf = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        values = self._codec.decode(buf, self._entry.numel, self._entry.dtype)
        if self._on_values is not None and values.size:
            self._on_values(self._entry.name, 0, values)
        return values


class _ElementwiseEntry:
    """A tensor of an elementwise codec (fp32, fp16, bf16), decoded piece by piece into its output array.

    The output is allocated once 1/`_ALLOCATE_AFTER` of the tensor's bytes have arrived; the pieces
    before that are kept as they came and decoded then, and so are pieces smaller than `_DECODE_MIN`
    until that much has arrived. A piece may end inside an element: its last few bytes wait for the
    next piece.
    """

    def __init__(self, codec: ElementwiseCodec, entry: ManifestEntry, on_values: ValuesSink | None = None) -> None:
        self._codec, self._entry, self._on_values = codec, entry, on_values
        self._out: np.ndarray | None = None
        self._staged: list[bytes | memoryview] = []  # pieces received but not decoded yet
        self._staged_nbytes = 0
        self._received = 0
        self._decoded = 0  # elements written to the output
        self._tail = b""  # the start of an element that the next piece completes

    def write(self, piece: memoryview, keep: bool) -> None:
        nbytes = self._entry.nbytes
        self._received += len(piece)
        # small pieces wait to be decoded together: per call, decoding has a fixed cost of several µs
        if self._received * _ALLOCATE_AFTER < nbytes or (
            self._staged_nbytes + len(piece) < _DECODE_MIN and self._received < nbytes
        ):
            self._staged.append(piece if keep else bytes(piece))
            self._staged_nbytes += len(piece)
            return
        if self._out is None:
            self._out = np.empty(self._entry.numel, WIRE_DTYPES[self._entry.dtype])
        staged, small = self._staged, self._staged_nbytes < _DECODE_MIN
        self._staged, self._staged_nbytes = [], 0
        if staged and small:
            self._decode(b"".join([*staged, piece]))
            return
        for earlier in staged:
            self._decode(earlier)
        self._decode(piece)

    def _decode(self, data: bytes | memoryview) -> None:
        k = self._codec.element_nbytes
        piece = memoryview(data)  # slices of it are views, not copies
        if self._tail:
            head = self._tail + bytes(piece[: k - len(self._tail)])
            piece = piece[k - len(self._tail) :]
            if len(head) < k:
                self._tail = head
                return
            self._tail = b""
            self._decode_whole(head)
        whole = len(piece) - len(piece) % k
        if whole:
            self._decode_whole(piece[:whole])
        if whole < len(piece):
            self._tail = bytes(piece[whole:])

    def _decode_whole(self, buf: bytes | memoryview) -> None:
        assert self._out is not None
        n = len(buf) // self._codec.element_nbytes
        values = self._out[self._decoded : self._decoded + n]
        self._codec.decode_into(buf, values, self._decoded)
        if self._on_values is not None:
            self._on_values(self._entry.name, self._decoded, values)
        self._decoded += n

    def finish(self) -> np.ndarray:
        if self._out is None:  # a tensor of no elements
            self._out = np.empty(self._entry.numel, WIRE_DTYPES[self._entry.dtype])
        return self._out


class _PayloadAssembler:
    """The payload's bytes -> the manifest's tensors, in order (validation step 8)."""

    def __init__(self, header: Header, codec: Codec, on_values: ValuesSink | None = None) -> None:
        self._codec = codec
        self._on_values = on_values
        self._manifest = header.manifest
        self._index = 0  # the manifest entry whose bytes are arriving
        self._left = 0  # bytes that entry still needs
        self._current: _ElementwiseEntry | _JoinedEntry | None = None
        self.tensors: dict[str, np.ndarray] = {}
        self._start_entry()

    @property
    def complete(self) -> bool:
        return self._index == len(self._manifest)

    def write(self, piece: memoryview, keep: bool) -> None:
        while len(piece):
            take = min(self._left, len(piece))
            self._guarded(lambda: self._current.write(piece[:take], keep))  # type: ignore[union-attr]
            piece = piece[take:]
            self._left -= take
            if self._left == 0:
                self._finish_entry()

    def _start_entry(self) -> None:
        """Begin the next entry with bytes, finishing the empty ones on the way."""
        while self._index < len(self._manifest):
            entry = self._manifest[self._index]
            codec = self._codec
            if isinstance(codec, ElementwiseCodec):
                self._current = _ElementwiseEntry(codec, entry, self._on_values)
            else:
                self._current = _JoinedEntry(codec, entry, self._on_values)
            self._left = entry.nbytes
            if entry.nbytes:
                return
            self._finish_entry(start_next=False)
        self._current = None

    def _finish_entry(self, start_next: bool = True) -> None:
        entry = self._manifest[self._index]
        flat = self._guarded(lambda: self._current.finish())  # type: ignore[union-attr]
        self.tensors[entry.name] = flat.reshape(entry.shape)
        self._index += 1
        if start_next:
            self._start_entry()

    def _guarded(self, step: Callable[[], Any]) -> Any:
        try:
            return step()
        except WireError as exc:
            entry = self._manifest[self._index]
            raise type(exc)(f"manifest entry {self._index} {entry.name!r}: {exc}") from None


class MessageDecoder:
    """Sans-IO decoder of one message: feed it bytes, in pieces of any size, until `done`.

    `bytes_needed()` is how many bytes complete the frame part being read, so a stream reader can
    ask for exactly that and never read past the message. `feed` raises a `WireError` as soon as
    something is wrong; after that the decoder is dead and raises it again.

    Tensors of the elementwise codecs (fp32, fp16, bf16) are decoded chunk by chunk into their
    output arrays as the bytes arrive, never joined. A reader that wants that work off its own
    thread feeds with `decode=False`, which only frames and queues the payload, and hands batches
    from `take_queued()` to `decode_queued` (on any one thread at a time, in order).

    `on_values`, if given, sees every tensor's values as they are decoded (see `ValuesSink`), before
    the message is complete: a consumer may start work on a tensor while the rest arrives, and must
    discard that work if the message then fails.
    """

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS, expected: Expectation | None = None,
                 on_values: ValuesSink | None = None) -> None:
        self._limits = limits
        self._expected = expected
        self._on_values = on_values
        self._phase = _Phase.HEADER_PREFIX
        self._buf = bytearray()  # the length prefix or header gathered so far
        self._header_len = 0
        self._header: Header | None = None
        self._assembler: _PayloadAssembler | None = None
        self._chunk_left = 0
        self._payload_left = 0
        self._queued: list[tuple[bytes | memoryview, bool]] = []  # payload pieces not yet decoded, and `keep`
        self._queued_nbytes = 0
        self._error: WireError | None = None
        self.bytes_fed = 0

    @property
    def done(self) -> bool:
        """The whole message has been read and decoded: `result()` is ready."""
        return (
            self._phase is _Phase.DONE
            and self._error is None
            and not self._queued
            and self._assembler is not None
            and self._assembler.complete
        )

    @property
    def header(self) -> Header | None:
        """The validated header, once its frame has been read."""
        return self._header

    @property
    def reading(self) -> str:
        """What the next bytes are, in words (for error messages)."""
        return self._phase.value

    @property
    def queued_nbytes(self) -> int:
        """Payload bytes read with `decode=False` and not yet taken by `take_queued()`."""
        return self._queued_nbytes

    def bytes_needed(self) -> int:
        phase = self._phase
        if phase in (_Phase.HEADER_PREFIX, _Phase.CHUNK_PREFIX):
            return PREFIX_BYTES - len(self._buf)
        if phase is _Phase.HEADER:
            return self._header_len - len(self._buf)
        if phase is _Phase.CHUNK:
            return self._chunk_left
        return 0

    def result(self) -> Message:
        if not self.done or self._header is None or self._assembler is None:
            raise RuntimeError(f"message incomplete: still reading the {self.reading}")
        return Message(self._header, self._assembler.tensors)

    def feed(self, data: bytes | bytearray | memoryview, *, decode: bool = True) -> None:
        """Read `data`; with decode=False its payload is only queued (see `take_queued`)."""
        if self._error is not None:
            raise self._error
        view = memoryview(data).cast("B")
        # slices of an immutable bytes object may be kept until a tensor completes; anything else is copied
        keep = type(data) is bytes
        try:
            self._consume(view, keep)
            if decode:
                self.decode_queued(self.take_queued())
            elif not keep:  # queued views of a buffer the caller may reuse: copy them now
                self._queued = [(bytes(piece), True) if not kept else (piece, kept) for piece, kept in self._queued]
        except WireError as exc:
            self._fail(exc)
            raise
        finally:
            self.bytes_fed += len(view)

    def take_queued(self) -> list[tuple[bytes | memoryview, bool]]:
        """The payload pieces queued so far, in order, for `decode_queued`."""
        queued, self._queued, self._queued_nbytes = self._queued, [], 0
        return queued

    def decode_queued(self, pieces: list[tuple[bytes | memoryview, bool]]) -> None:
        """Decode pieces from `take_queued()` into the tensors; may run on a worker thread while
        `feed(decode=False)` runs on another. Raises the first WireError, which kills the decoder."""
        assembler = self._assembler  # the reading thread drops it if framing fails meanwhile
        if self._error is not None:
            raise self._error
        if not pieces:
            return
        assert assembler is not None
        try:
            for piece, keep in pieces:
                assembler.write(memoryview(piece), keep)
        except WireError as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: WireError) -> None:
        self._error = exc
        self._phase = _Phase.FAILED
        self._queued, self._queued_nbytes = [], 0
        self._assembler = None

    def _consume(self, view: memoryview, keep: bool) -> None:
        pos, end = 0, len(view)
        while pos < end:
            phase = self._phase
            if phase is _Phase.DONE:
                raise BadSchema(f"{end - pos} bytes after the end of the message")
            if phase is _Phase.CHUNK:
                take = min(self._chunk_left, end - pos)
                self._queued.append((view[pos : pos + take], keep))
                self._queued_nbytes += take
                pos += take
                self._chunk_left -= take
                self._payload_left -= take
                if self._chunk_left == 0:
                    self._phase = _Phase.CHUNK_PREFIX if self._payload_left else _Phase.DONE
                continue
            take = min(self.bytes_needed(), end - pos)
            self._buf += view[pos : pos + take]
            pos += take
            if self.bytes_needed():
                continue
            if phase is _Phase.HEADER:
                body, self._buf = self._buf, bytearray()
                self._on_header(body)
            else:
                length = _PREFIX.unpack(self._buf)[0]
                self._buf.clear()
                self._on_prefix(length)

    def _on_prefix(self, length: int) -> None:
        limits = self._limits
        if self._phase is _Phase.HEADER_PREFIX:
            if length > limits.max_header_bytes:
                raise FrameTooLarge(
                    f"header frame of {length} bytes exceeds max_header_bytes ({limits.max_header_bytes})"
                )
            if length == 0:
                raise BadSchema("empty header frame")
            self._header_len = length
            self._phase = _Phase.HEADER
            return
        if length == 0:
            raise BadSchema("empty payload chunk")
        if length > limits.max_chunk_bytes:
            raise FrameTooLarge(f"payload chunk of {length} bytes exceeds max_chunk_bytes ({limits.max_chunk_bytes})")
        if length > self._payload_left:
            raise ManifestMismatch(
                f"payload chunk of {length} bytes, but the manifest leaves only {self._payload_left} bytes"
            )
        self._chunk_left = length
        self._phase = _Phase.CHUNK

    def _on_header(self, body: bytearray) -> None:
        header, codec = parse_header(body, self._limits)
        if self._expected is not None:
            check_expectation(header, self._expected)
        self._header = header
        self._assembler = _PayloadAssembler(header, codec, self._on_values)
        self._payload_left = header.payload_nbytes
        self._phase = _Phase.CHUNK_PREFIX if self._payload_left else _Phase.DONE


def decode_message(
    buf: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS, expected: Expectation | None = None
) -> Message:
    """Decode one whole message from `buf`; Truncated if it ends early, BadSchema if bytes follow it."""
    decoder = MessageDecoder(limits, expected)
    decoder.feed(buf)
    if not decoder.done:
        raise Truncated(
            f"message ends after {decoder.bytes_fed} bytes, {decoder.bytes_needed()} bytes short of "
            f"completing the {decoder.reading}"
        )
    return decoder.result()


async def read_message(
    read_exactly: Callable[[int], Awaitable[bytes]],
    limits: WireLimits = DEFAULT_LIMITS,
    expected: Expectation | None = None,
    *,
    timeout: float | None = None,
    on_values: ValuesSink | None = None,
) -> Message:
    """Read one message from a stream through `read_exactly(n)`, which returns n bytes or raises at EOF.

    EOF (EOFError, including asyncio.IncompleteReadError, or ConnectionError, including
    gossip.transport.StreamClosed) or a short read becomes Truncated. `timeout` bounds the whole
    message; None leaves the deadline to the caller (who must then set one).

    Large payloads are decoded on a worker thread, batch by batch while the next bytes are read,
    so the event loop only frames; at most one batch is being decoded at a time. `on_values` sees
    the values as they are decoded (see `MessageDecoder`), on the decoding thread.
    """
    decoder = MessageDecoder(limits, expected, on_values)
    loop = asyncio.get_running_loop()
    decoding: asyncio.Future[None] | None = None  # the batch a worker thread is decoding
    try:
        async with asyncio.timeout(timeout):
            while needed := decoder.bytes_needed():
                try:
                    data = await read_exactly(needed)
                except (EOFError, ConnectionError) as exc:
                    raise Truncated(
                        f"stream ended after {decoder.bytes_fed} bytes, while reading the {decoder.reading}"
                    ) from exc
                if len(data) != needed:
                    raise Truncated(f"asked for {needed} bytes of the {decoder.reading}, got {len(data)}")
                decoder.feed(data, decode=False)
                if decoder.queued_nbytes >= _OFFLOAD_BYTES:
                    if decoding is not None:
                        await asyncio.shield(decoding)
                    decoding = loop.run_in_executor(None, decoder.decode_queued, decoder.take_queued())
            if decoding is not None:
                await asyncio.shield(decoding)
            decoder.decode_queued(decoder.take_queued())  # less than one batch: not worth a thread hop
    finally:
        if decoding is not None:
            # failing or cancelled with a batch in flight: the worker finishes with the decoder before it
            # is dropped, and its outcome is retrieved here (the error that ended the read is the one raised)
            if not decoding.done():
                await asyncio.wait([decoding])
            if not decoding.cancelled():
                decoding.exception()
    return decoder.result()
