"""The message header: its declared schema (msgspec Structs, the msgpack map on the wire), the bounds and
expectations a receiver holds it to, and its validation (steps 2-6 of the `gossip.wire` docstring)."""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NamedTuple, TypedDict, Unpack, cast

import msgpack
import msgspec
import numpy as np

from gossip.codecs import WIRE_DTYPES, Codec, codec_from_wire, dtype_name
from gossip.errors import BadSchema, FrameTooLarge, ManifestMismatch, UnknownCodec, VersionMismatch, WrongSwarm

PROTOCOL_VERSION = 1
HEADER_KEYS = (
    "v", "swarm", "config_hash", "sender", "round", "step", "kind", "codec", "codec_opts", "manifest", "meta",
)  # fmt: skip

_MAX_INT = (1 << 63) - 1

MetaValue = None | bool | int | float | str
# The schema's static bounds; those a receiver chooses (lengths in UTF-8 bytes, counts) are in `WireLimits`.
Name = Annotated[str, msgspec.Meta(min_length=1)]
Uint = Annotated[int, msgspec.Meta(ge=0, le=_MAX_INT)]
WireDtype = Literal["float32", "float16", "float64"]  # the keys of gossip.codecs.WIRE_DTYPES


@dataclass(frozen=True)
class WireLimits:
    """Bounds a receiver enforces before allocating anything; both ends should use the same ones."""

    max_header_bytes: int = 1 << 20
    max_tensors: int = 65536
    max_ndim: int = 8
    max_chunk_bytes: int = 4 << 20
    max_payload_bytes: int = 4 << 30
    max_decoded_bytes: int = 4 << 30  # decoded tensors in their manifest dtypes, all together
    max_name_len: int = 256  # every string in the header but meta's values, in UTF-8 bytes
    max_meta_entries: int = 64
    max_meta_value_len: int = 1024  # a meta string value (a membership certificate is ~360 bytes)


DEFAULT_LIMITS = WireLimits()


class TensorSpec(NamedTuple):
    """What a tensor is, without its values: name, wire dtype name, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


class ManifestEntry(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One tensor in a header, on the wire [name, dtype, shape, nbytes]: its spec and its encoded length."""

    name: Name
    dtype: WireDtype
    shape: tuple[Uint, ...]
    nbytes: Uint

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)


class Header(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A message header, as sent and as validated on receipt; fields in `HEADER_KEYS` order, which is
    the order of the msgpack map on the wire (`version` is the key "v")."""

    version: int = msgspec.field(name="v")
    swarm: Name
    config_hash: Name
    sender: Name
    round: Uint
    step: Uint
    kind: Name
    codec: Name
    codec_opts: dict[Name, int | float]
    manifest: tuple[ManifestEntry, ...]
    meta: dict[Name, MetaValue]

    @property
    def payload_nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.manifest)


class HeaderFields(TypedDict):
    """The header fields a sender chooses per message (the rest follow from the codec and the tensors)."""

    swarm: str
    config_hash: str
    sender: str
    round: int
    step: int
    kind: str


# Raises gossip.errors.NotMember unless the header's sender (the stream's peer) is admitted to the swarm.
Admit = Callable[["Header"], None]


@dataclass(frozen=True)
class Expectation:
    """What a receiver accepts: its swarm and config, optionally its model's exact manifest and codecs,
    the sender the stream comes from, and who is admitted (checked before any payload is read)."""

    swarm: str
    config_hash: str
    manifest: tuple[TensorSpec, ...] | None = None  # None: any manifest within the limits
    allowed_codecs: frozenset[str] | None = None  # None: any known codec
    sender: str | None = None  # the stream's peer, as its transport authenticated it; None: any
    admit: Admit | None = None  # None: anyone (an open swarm)

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


def tensor_specs(tensors: Mapping[str, np.ndarray]) -> tuple[TensorSpec, ...]:
    """Name, dtype and shape of each tensor, in order; TypeError for a dtype the wire does not carry."""
    specs = []
    for name, tensor in tensors.items():
        if not isinstance(tensor, np.ndarray | np.generic):
            raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a numpy array")
        specs.append(TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape)))
    return tuple(specs)


def manifest_for(specs: Iterable[TensorSpec], codec: Codec) -> tuple[ManifestEntry, ...]:
    """The manifest entries `codec` gives these tensors: each one's encoded length on the wire."""
    return tuple(
        # a spec's dtype comes from dtype_name, which only returns wire dtypes
        ManifestEntry(name, cast(WireDtype, dtype), tuple(int(s) for s in shape), codec.encoded_nbytes(math.prod(shape)))
        for name, dtype, shape in specs
    )


def make_header(
    specs: Iterable[TensorSpec],
    codec: Codec,
    *,
    meta: Mapping[str, MetaValue] | None,
    **fields: Unpack[HeaderFields],
) -> Header:
    """The header `codec` gives these tensors (not validated: `parse_header(pack_header(...))` does that)."""
    manifest = manifest_for(specs, codec)
    return Header(
        version=PROTOCOL_VERSION,
        codec=codec.name,
        codec_opts=dict(codec.options()),
        manifest=manifest,
        meta=dict(meta or {}),
        **fields,
    )


def pack_header(header: Header) -> bytes:
    """The header frame's body: the msgpack map, keys in `HEADER_KEYS` order."""
    return msgspec.msgpack.encode(header)


# ---------------------------------------------------------------------------------------------
# step 2: msgpack with per-container limits. msgspec's own decoder would allocate no more than
# this, but it takes the last of repeated map keys, which the wire refuses.


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


# ---------------------------------------------------------------------------------------------
# step 3: msgspec's ValidationError, said in the header's terms

_ERROR_AT = re.compile(r"^(?P<text>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?$", re.DOTALL)
_PATH_PART = re.compile(r"\.(\w+)|\[(\d+|\.\.\.)\]")
_ENTRY_FIELDS = ("name", "dtype", "shape", "nbytes")
_MAP_VALUES: dict[str, Any] = {"meta": dict[Name, MetaValue], "codec_opts": dict[Name, int | float]}


def _bad_item(field: str, mapping: dict[Any, Any]) -> tuple[object, bool]:
    """The first key of a header map that fails its schema, and whether the key itself is at fault."""
    for key, value in mapping.items():
        try:
            msgspec.convert({key: value}, _MAP_VALUES[field])
        except msgspec.ValidationError as exc:
            return key, " - at `key` in " in str(exc)
    return None, False


def _subject(parts: list[str], obj: dict[str, Any], key_at_fault: bool) -> tuple[str, object]:
    """What failed, in words, and its value."""
    if not parts:
        return "header", obj
    field, rest = parts[0], parts[1:]
    value: Any = obj.get(field)
    if field in _MAP_VALUES and (rest or key_at_fault) and type(value) is dict:
        key, is_key = _bad_item(field, value)
        is_key = is_key or key_at_fault
        what = "a meta key" if field == "meta" else "a codec_opts key"
        if not is_key:
            what = f"meta {key!r}" if field == "meta" else f"codec option {key!r}"
        return what, key if is_key else value[key]
    if field != "manifest" or not rest:
        return f"header {field!r}", value
    index = int(rest[0])
    value = value[index]
    if len(rest) == 1:
        return f"manifest entry {index}", value
    what = f"manifest entry {index}: {_ENTRY_FIELDS[int(rest[1])]}"
    value = value[int(rest[1])]
    if len(rest) > 2:
        return f"manifest entry {index}: a dimension", value[int(rest[2])]
    return (f"manifest entry {index} name" if rest[1] == "0" else what), value


def _short(value: object) -> str:
    """A peer's value as an error names it: bounded in depth and length (a value nested a thousand lists
    deep would exhaust the stack of a plain repr, and a long one would flood the log)."""
    shorter = reprlib.Repr()
    shorter.maxlevel, shorter.maxstring, shorter.maxother, shorter.maxlist = 3, 80, 80, 8
    return shorter.repr(value)


def _problem(text: str, what: str, value: object) -> str:
    got = type(value).__name__
    if text.startswith("Expected `str` of length >= 1"):
        return "is empty"
    if text.startswith("Expected `int | float`"):
        return f"must be a number, got {got}"
    if text.startswith("Expected `bool | int | float | str | null`"):
        return f"must be None, bool, int, float or str, got {got}"
    if text.startswith("Expected `int`"):
        return f"must be an integer in [0, 2^63), got {_short(value)}"
    if text.startswith("Expected `str`"):
        return f"must be a string, got {got}"
    if text.startswith("Expected `object`"):
        return f"must be a map, got {got}"
    if text.startswith("Expected `array`"):
        if what.startswith("manifest entry") and what[-1].isdigit():
            return "must be [name, dtype, shape, nbytes]"
        return f"must be a list of integers, got {got}" if what.endswith("shape") else f"must be a list, got {got}"
    if text.startswith("Invalid enum value"):
        return f"{_short(value)} is not one of {', '.join(WIRE_DTYPES)}"
    return f"is invalid: {text}"


def _schema_error(exc: msgspec.ValidationError, obj: dict[str, Any]) -> BadSchema:
    """The BadSchema for msgspec's verdict on `obj`, the unpacked header map, naming the field at fault."""
    text = str(exc)
    if text.startswith("Object missing required field"):
        return BadSchema(f"header is missing {', '.join(key for key in HEADER_KEYS if key not in obj)}")
    if text.startswith("Object contains unknown field"):
        return BadSchema(f"header has unknown keys {', '.join(sorted(repr(k) for k in obj if k not in HEADER_KEYS))}")
    match = _ERROR_AT.match(text)
    assert match is not None  # the pattern matches any text
    parts = [name or index for name, index in _PATH_PART.findall(match["path"] or "")]
    what, value = _subject(parts, obj, match["key"] is not None)
    return BadSchema(f"{what} {_problem(match['text'], what, value)}")


# ---------------------------------------------------------------------------------------------
# steps 3-5: the bounds a receiver chose, the codec and the manifest's sizes


def _check_len(value: str, what: str, limits: WireLimits) -> None:
    size = len(value.encode())
    if size > limits.max_name_len:
        raise FrameTooLarge(f"{what} is {size} bytes long, over max_name_len ({limits.max_name_len})")


def _check_bounds(header: Header, limits: WireLimits) -> None:
    for key in ("swarm", "config_hash", "sender", "kind", "codec"):
        _check_len(getattr(header, key), f"header {key!r}", limits)
    for key in header.codec_opts:
        _check_len(key, "a codec_opts key", limits)
    if len(header.meta) > limits.max_meta_entries:
        raise FrameTooLarge(f"meta has {len(header.meta)} entries, over max_meta_entries ({limits.max_meta_entries})")
    for key, value in header.meta.items():
        _check_len(key, "a meta key", limits)
        if type(value) is str and len(value.encode()) > limits.max_meta_value_len:
            raise FrameTooLarge(f"meta {key!r} is {len(value.encode())} bytes long, over max_meta_value_len "
                                f"({limits.max_meta_value_len})")
    if len(header.manifest) > limits.max_tensors:
        raise FrameTooLarge(f"manifest has {len(header.manifest)} tensors, over max_tensors ({limits.max_tensors})")


def _check_manifest(manifest: tuple[ManifestEntry, ...], codec: Codec, limits: WireLimits) -> None:
    names: set[str] = set()
    payload = decoded = 0
    for i, entry in enumerate(manifest):
        _check_len(entry.name, f"manifest entry {i} name", limits)
        where = f"manifest entry {i} {entry.name!r}"
        if entry.name in names:
            raise BadSchema(f"{where}: name appears twice")
        names.add(entry.name)
        if len(entry.shape) > limits.max_ndim:
            raise FrameTooLarge(f"{where}: {len(entry.shape)} dimensions, over max_ndim ({limits.max_ndim})")
        numel = entry.numel
        if not codec.accepts_nbytes(numel, entry.nbytes):
            raise ManifestMismatch(
                f"{where}: {entry.nbytes} bytes on the wire, but {codec.name} encodes {numel} elements "
                f"in {codec.encoded_nbytes(numel)} bytes"
            )
        # an empty tensor's other dimensions count too: numpy refuses a shape whose extent overflows
        extent = math.prod(max(1, d) for d in entry.shape) * WIRE_DTYPES[entry.dtype].itemsize
        if extent > limits.max_decoded_bytes:
            raise FrameTooLarge(f"{where}: shape {_short(list(entry.shape))} spans {extent} bytes, over "
                                f"max_decoded_bytes ({limits.max_decoded_bytes})")
        payload += entry.nbytes
        decoded += numel * WIRE_DTYPES[entry.dtype].itemsize
        if payload > limits.max_payload_bytes:
            raise FrameTooLarge(
                f"manifest declares at least {payload} payload bytes, "
                f"over max_payload_bytes ({limits.max_payload_bytes})"
            )
        if decoded > limits.max_decoded_bytes:
            raise FrameTooLarge(
                f"tensors decode to at least {decoded} bytes, over max_decoded_bytes ({limits.max_decoded_bytes})"
            )


def parse_header(body: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS) -> tuple[Header, Codec]:
    """Validate a header frame's body (steps 2-5 of the `gossip.wire` docstring); returns it and its codec."""
    obj = _unpack(body, limits)
    if type(obj) is not dict:
        raise BadSchema(f"header must be a msgpack map, got {type(obj).__name__}")
    version = obj.get("v")
    if type(version) is not int:
        raise BadSchema("header has no integer 'v' (protocol version)")
    if version != PROTOCOL_VERSION:  # before the schema: another version may have other keys
        raise VersionMismatch(f"protocol version {version}, this node speaks {PROTOCOL_VERSION}")
    try:
        header = msgspec.convert(obj, Header)
    except msgspec.ValidationError as exc:
        raise _schema_error(exc, obj) from None
    _check_bounds(header, limits)
    codec = codec_from_wire(header.codec, header.codec_opts)
    _check_manifest(header.manifest, codec, limits)
    return header, codec


def check_expectation(header: Header, expected: Expectation) -> None:
    """Step 6: BadSchema, WrongSwarm, NotMember, UnknownCodec or ManifestMismatch if `header` is not what
    the receiver accepts."""
    if expected.sender is not None and header.sender != expected.sender:
        raise BadSchema(f"header names sender {header.sender}, but the stream comes from {expected.sender}")
    if header.swarm != expected.swarm:
        raise WrongSwarm(f"swarm {header.swarm!r}, expected {expected.swarm!r}")
    if header.config_hash != expected.config_hash:
        raise WrongSwarm(f"config hash {header.config_hash!r}, expected {expected.config_hash!r}")
    if expected.admit is not None:
        expected.admit(header)
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
