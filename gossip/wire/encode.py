"""The sender's side: a message's buffers (header frame, then payload chunk frames), encoded lazily,
and the exact size a message would take on the wire."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Unpack

import numpy as np

from gossip.codecs import Codec, ElementwiseCodec, dtype_name
from gossip.errors import FrameTooLarge, WireError
from gossip.wire.frames import DEFAULT_CHUNK_BYTES, PREFIX_BYTES, frame_prefix
from gossip.wire.header import (
    DEFAULT_LIMITS,
    HeaderFields,
    ManifestEntry,
    MetaValue,
    TensorSpec,
    WireLimits,
    make_header,
    manifest_for,
    pack_header,
    parse_header,
    tensor_specs,
)

_ZERO_COPY_MIN = 64 << 10  # chunks at least this large go out as a view of the encoded tensor, not a copy

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
        prefix = frame_prefix(pending_len)
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


@dataclass(frozen=True, eq=False)
class EncodedTensors:
    """Tensors kept as `codec` puts them on the wire: a message of them sends these bytes, and they take
    the wire's size in memory, not float32's (a gossip peer's past round inputs under a lossy codec)."""

    codec: Codec
    specs: tuple[TensorSpec, ...]
    payloads: tuple[np.ndarray, ...]  # uint8, one per tensor, in `specs` order

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.payloads)


def encode_tensors(tensors: Mapping[str, np.ndarray], codec: Codec,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> EncodedTensors:
    """`tensors` as `codec` encodes them, one tensor's bytes at a time (never a whole model's float32
    beside them); raises what encoding them for a message would (NonFiniteValues, TypeError)."""
    specs = tensor_specs(tensors)
    payloads = []
    for (name, tensor), entry in zip(tensors.items(), manifest_for(specs, codec)):
        out, at = np.empty(entry.nbytes, dtype=np.uint8), 0
        for piece in _encoded_payloads({name: tensor}, codec, (entry,), chunk_bytes):
            out[at : at + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
            at += len(piece)
        payloads.append(out)
    return EncodedTensors(codec, specs, tuple(payloads))


def iter_message(
    tensors: Mapping[str, np.ndarray] | EncodedTensors,
    codec: Codec,
    *,
    meta: Mapping[str, MetaValue] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    limits: WireLimits = DEFAULT_LIMITS,
    **fields: Unpack[HeaderFields],
) -> Iterator[bytes | memoryview]:
    """The message's buffers, in order, encoded as they are asked for: a writer sends the first chunks
    while later ones are still being encoded. The header is checked before the first buffer is
    returned; a tensor's values are checked when its buffers are reached, so NonFiniteValues (or
    TypeError) can come after earlier buffers were taken. See `encode_message` for the rest.
    `EncodedTensors` (kept in this same codec) are sent as they are."""
    _check_chunk_bytes(chunk_bytes, limits)
    if isinstance(tensors, EncodedTensors):
        if (tensors.codec.name, tensors.codec.options()) != (codec.name, codec.options()):
            raise ValueError(f"tensors kept in codec {tensors.codec.name} {tensors.codec.options()} cannot be sent "
                             f"in {codec.name} {codec.options()}")
        specs = tensors.specs
    else:
        specs = tensor_specs(tensors)
    header = make_header(specs, codec, meta=meta, **fields)
    body = pack_header(header)
    if len(body) > limits.max_header_bytes:
        raise FrameTooLarge(f"header of {len(body)} bytes exceeds max_header_bytes ({limits.max_header_bytes})")
    parse_header(body, limits)  # refuse to send what a receiver would refuse
    payloads = ((p.data for p in tensors.payloads) if isinstance(tensors, EncodedTensors)
                else _encoded_payloads(tensors, codec, header.manifest, chunk_bytes))
    return _message_buffers(frame_prefix(len(body)) + body, _chunk_frames(payloads, chunk_bytes))


def _message_buffers(head: bytes, frames: Iterator[bytes | memoryview]) -> Iterator[bytes | memoryview]:
    yield head
    yield from frames


def encode_message(
    tensors: Mapping[str, np.ndarray],
    codec: Codec,
    *,
    meta: Mapping[str, MetaValue] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    limits: WireLimits = DEFAULT_LIMITS,
    **fields: Unpack[HeaderFields],
) -> list[bytes | memoryview]:
    """The message as buffers to write in order (their concatenation is the message).

    Large chunks are views of the encoded tensors (for fp32 and float32 tensors, of the tensors
    themselves): do not modify the tensors until the buffers are written. Raises what a receiver
    with the same `limits` would raise for this header (FrameTooLarge, BadSchema), NonFiniteValues
    for non-finite or unrepresentable values, TypeError for an unsupported dtype.
    """
    return list(iter_message(tensors, codec, meta=meta, chunk_bytes=chunk_bytes, limits=limits, **fields))


def _specs_of(tensors: Mapping[str, np.ndarray | tuple[Iterable[int], Any]] | Iterable[TensorSpec] | EncodedTensors,
              ) -> list[TensorSpec]:
    if isinstance(tensors, EncodedTensors):
        return list(tensors.specs)
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
    tensors: Mapping[str, np.ndarray | tuple[Iterable[int], Any]] | Iterable[TensorSpec] | EncodedTensors,
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
    header = make_header(
        specs, codec, swarm=swarm, config_hash=config_hash, sender=sender, round=round, step=step, kind=kind, meta=meta
    )
    payload = header.payload_nbytes
    return PREFIX_BYTES + len(pack_header(header)) + payload + PREFIX_BYTES * -(-payload // chunk_bytes)
