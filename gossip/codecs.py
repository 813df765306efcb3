"""Tensor codecs for the wire: how one flat float tensor becomes bytes and back (fp32, fp16, bf16, int8, top-k).

Every codec takes a numpy array of float32, float16 or float64 (other dtypes raise `TypeError`),
encodes it flat in C order, and decodes into a fresh, writable, flat array of the dtype asked for.
Multi-byte values on the wire are little-endian. Encoding refuses NaN, infinity and values the
codec cannot represent (`NonFiniteValues`); decoding checks everything a hostile peer could send
and raises `NonFiniteValues` (or `BadSchema` for a malformed top-k/int8 layout) instead of ever
returning a non-finite value. float64 sources are rounded to float32 first: every codec carries
float32 precision at most.

Layouts and error bounds (x a source value, x^ its decoded value; "float32 source" also covers float16):

- ``fp32``: n float32 (4n bytes). Exact for float32/float16 sources.
- ``fp16``: n IEEE binary16 (2n bytes), round to nearest even. |x - x^| <= 2^-11 |x| + 2^-25.
  |x| > 65504 raises `NonFiniteValues` rather than becoming infinity.
- ``bf16``: n bfloat16 (2n bytes: the high half of the float32, round to nearest even).
  |x - x^| <= 2^-8 |x| + 2^-134. |x| >= 3.3961e38 (which would round to infinity) raises, and for
  float16 tensors |x| >= 65408 (which would round to 65536, beyond float16) raises.
- ``int8`` (option ``block``, default 256): the scales of ceil(n / block) blocks as float32, then n
  int8 values (4 ceil(n/block) + n bytes). A block's scale is s = max|x| / 127, values are
  round(x / s); |x - x^| <= s (1/2 + 2^-14) (the 2^-14 covers float32 rounding). A block whose
  max|x| < 2^-100 is sent with s = 0 (all zeros; error below 2^-100). For float16 tensors the
  decoded value is then rounded to float16 (another 2^-11 |x^| + 2^-25).
- ``topk`` (option ``ratio`` in (0, 1]): k = min(n, max(1, ceil(ratio * n))) for n > 0 (0 for
  n = 0) entries of largest magnitude: k uint32 indices, strictly increasing, then their k float32
  values (8k bytes). Unsent entries decode as 0. The decoder accepts any k <= n (8k bytes) so
  a sender may send fewer; it requires indices strictly increasing and < n, and n < 2^32.
  Top-k alone drops what it does not send; `ErrorFeedback` keeps that residual on the sender.

fp16/bf16 conversions are written with integer bit operations on cache-sized blocks because
numpy's own float16 cast is a scalar loop (several times slower than a memory copy).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Protocol

import numpy as np
from numpy.typing import DTypeLike

from gossip.errors import BadSchema, NonFiniteValues, UnknownCodec

if sys.byteorder != "little":  # the bit-level views below read the wire's little-endian bytes natively
    raise ImportError("gossip.codecs needs a little-endian host")

WIRE_DTYPES: Mapping[str, np.dtype] = MappingProxyType(
    {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "float64": np.dtype(np.float64)}
)

Buffer = bytes | bytearray | memoryview
OptionValue = int | float

_BLOCK = 1 << 17  # elements per cache-sized block in the blockwise conversions
_FIXUP_SEGMENT = 256  # fp16: granularity at which blocks with float16-subnormal values are re-done
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _const(value: float, dtype: DTypeLike) -> np.ndarray:
    # read-only 0-d arrays: ufuncs take them with less per-call overhead than numpy scalars
    arr = np.array(value, dtype)
    arr.flags.writeable = False
    return arr


_U32_1 = _const(1, np.uint32)
_U32_13 = _const(13, np.uint32)
_U32_16 = _const(16, np.uint32)
_I32_13 = _const(13, np.int32)
_U16_ABS = _const(0x7FFF, np.uint16)
# float32 bit patterns (as uint32), shifted left by one to drop the sign
_F16_MAX_SHL = np.uint32(0x477FE000 << 1)  # 65504, the largest finite float16
_F16_MIN_NORMAL_SHL = np.uint32(0x38800000 << 1)  # 2^-14, the smallest normal float16
# float32 -> float16 rounding: add 0xfff + (bit 13) for round-to-nearest-even, subtract 112 from the
# exponent (127 - 15) to rebias; modulo 2^32 so it is one unsigned add
_F16_ROUND_REBIAS = _const((0xFFF - (112 << 23)) % (1 << 32), np.uint32)
# after an arithmetic shift by 13 the sign fills bits 18..31; keep bit 28 and 31 (moving the sign from
# bit 31 to bit 28, which lands on bit 15 after the final shift) and bit 0 (the round-to-even bit)
_F16_SIGN_AND_ODD = _const(0x90000001, np.uint32)
_F16_SIGN_KEEP = _const(-0x70000001, np.int32)  # 0x8FFFFFFF: clears bits 28..30 of a sign-extended half << 13
_F16_REBIAS_UP = _const(2.0**112, np.float32)
_BF16_ROUND = _const(0x7FFF, np.uint32)
_BF16_LIMIT = float(np.array([0x7F7F8000], np.uint32).view(np.float32)[0])  # rounds to bfloat16 inf
_BF16_F16_LIMIT = 65408.0  # halfway between bfloat16's 65280 and 65536: ties round to 65536, beyond float16
_INT8_TINY = np.float32(2.0**-100)
_INT8_MAX_SCALE = _FLOAT32_MAX / 128  # larger scales could overflow float32 on decode


def dtype_name(dtype: DTypeLike) -> str:
    """The wire name of a supported dtype ("float32", "float16", "float64"); TypeError for any other."""
    dt = np.dtype(dtype)
    if dt.kind == "f" and dt.name in WIRE_DTYPES:
        return dt.name
    raise TypeError(f"dtype {dt} cannot go on the wire: use float32, float16 or float64")


def _flat_source(x: np.ndarray) -> np.ndarray:
    """x as a flat, C-contiguous, native-order array of a wire dtype (a view when x already is one)."""
    if not isinstance(x, np.ndarray | np.generic):
        raise TypeError(f"expected a numpy array, got {type(x).__name__}")
    name = dtype_name(x.dtype)
    return np.ascontiguousarray(x, dtype=WIRE_DTYPES[name]).reshape(-1)


def _blocks(n: int, size: int = _BLOCK) -> Iterator[tuple[int, int]]:
    for start in range(0, n, size):
        yield start, min(n, start + size)


def _bad_value_message(values: np.ndarray, offset: int, limit: float, what: str) -> str:
    bad = np.flatnonzero(~(np.abs(values.astype(np.float64)) <= limit))
    i = int(bad[0]) if bad.size else 0
    return f"element {offset + i} is {float(values[i])!r}: {what}"


def _check_finite_f32(block: np.ndarray, offset: int) -> None:
    # min/max propagate NaN and expose +-inf, and read the block without writing a temporary
    if block.size and not (np.isfinite(block.min()) and np.isfinite(block.max())):
        raise NonFiniteValues(_bad_value_message(block, offset, _FLOAT32_MAX, "not finite"))


class _Scratch:
    """Per-call work buffers for the blockwise conversions (one block each)."""

    def __init__(self, size: int) -> None:
        self.f32 = np.empty(size, np.float32)
        self.u32 = np.empty(size, np.uint32)
        self.u16 = np.empty(size, np.uint16)


def _check_f16_bits(bits: np.ndarray, scratch: _Scratch, offset: int) -> None:
    """NonFiniteValues if any float16 (given as uint16 bits) is an infinity or NaN."""
    mag = np.bitwise_and(bits, _U16_ABS, scratch.u16[: bits.size])
    if mag.size and mag.max() >= 0x7C00:
        i = int(np.argmax(mag >= 0x7C00))
        raise NonFiniteValues(f"element {offset + i} is a float16 infinity or NaN")


def _f16_bits_to_f32(h: np.ndarray, out: np.ndarray, scratch: _Scratch, offset: int) -> None:
    """float16 bits (uint16) -> float32, exact; NonFiniteValues for inf/NaN halves."""
    if h.size == 0:
        return
    _check_f16_bits(h, scratch, offset)
    t = out.view(np.int32)
    tu = out.view(np.uint32)
    np.copyto(t, h.view(np.int16))  # sign-extends: the sign lands on bit 31 (and 15..30)
    np.left_shift(tu, _U32_13, tu)  # exponent and mantissa into float32 position
    np.bitwise_and(t, _F16_SIGN_KEEP, t)
    # multiplying by 2^112 rebiases the exponent; float16 subnormals were float32 subnormals and
    # come out normalised by the multiply
    np.multiply(out, _F16_REBIAS_UP, out)


def _f32_to_f16_bits(
    x: np.ndarray, out: np.ndarray, t: np.ndarray, segments: np.ndarray, offset: int
) -> np.ndarray | None:
    """float32 block -> float16 bits in `out`, round to nearest even, for the float16 normal range.

    `t` is a uint32 temporary of the block's size, reused by every step so the block stays in
    cache; `segments` are the starts of `_FIXUP_SEGMENT`-sized segments of the block. Returns the
    block-relative indices of values in the float16 subnormal range (|x| < 2^-14), which this
    integer path gets wrong and the caller redoes, or None. NonFiniteValues for NaN, inf, |x| > 65504.
    """
    u = x.view(np.uint32)
    np.left_shift(u, _U32_1, t)  # drop the sign: compare magnitudes as integers
    if t.max() > _F16_MAX_SHL:
        raise NonFiniteValues(_bad_value_message(x, offset, 65504.0, "outside float16's range of +-65504"))
    seg_mins = np.minimum.reduceat(t, segments)  # one cheap pass finds the few segments to look into
    flagged = None
    if seg_mins.min() < _F16_MIN_NORMAL_SHL:
        starts = segments[seg_mins < _F16_MIN_NORMAL_SHL]
        candidates = (starts[:, None] + np.arange(_FIXUP_SEGMENT)).reshape(-1)
        candidates = candidates[candidates < t.size]
        flagged = candidates[t[candidates] < _F16_MIN_NORMAL_SHL]
    np.right_shift(x.view(np.int32), _I32_13, t.view(np.int32))
    np.bitwise_and(t, _F16_SIGN_AND_ODD, t)  # sign at bits 28 and 31, round-to-even bit at 0
    np.add(t, u, t)
    np.add(t, _F16_ROUND_REBIAS, t)
    np.right_shift(t, _U32_13, t)
    np.copyto(out, t, casting="unsafe")  # keeps the low 16 bits: sign, exponent, mantissa
    return flagged


def _f32_to_bf16_bits(x: np.ndarray, out: np.ndarray, scratch: _Scratch) -> None:
    """float32 -> bfloat16 bits, round to nearest even (no check: callers validate the range)."""
    n = x.size
    if n == 0:
        return
    u = x.view(np.uint32)
    t = scratch.u32[:n]
    np.right_shift(u, _U32_16, t)
    np.bitwise_and(t, _U32_1, t)  # round-to-even bit
    np.add(t, _BF16_ROUND, t)
    np.add(t, u, t)
    np.right_shift(t, _U32_16, t)
    np.copyto(out, t, casting="unsafe")


def _check_bf16_range(x: np.ndarray, offset: int, limit: float) -> None:
    if x.size and not (x.max() < limit and x.min() > -limit):
        below = np.nextafter(limit, 0)
        raise NonFiniteValues(_bad_value_message(x, offset, below, f"must stay below {limit:.5g} in bf16"))


def _bf16_bits_to_f32(h: np.ndarray, out: np.ndarray, scratch: _Scratch, offset: int) -> None:
    n = h.size
    if n == 0:
        return
    mag = np.bitwise_and(h, _U16_ABS, scratch.u16[:n])
    if mag.max() >= 0x7F80:
        i = int(np.argmax(mag >= 0x7F80))
        raise NonFiniteValues(f"element {offset + i} is a bfloat16 infinity or NaN")
    t = out.view(np.uint32)
    np.copyto(t, h)
    np.left_shift(t, _U32_16, t)


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """IEEE-style float32 -> bfloat16 bits (uint16): round to nearest even, overflow to inf, NaN stays NaN.

    The bf16 codec refuses non-finite input before converting; this is the same conversion for
    callers (and tests) that want the full float semantics.
    """
    x32 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty(x32.size, np.uint16)
    scratch = _Scratch(min(_BLOCK, max(1, x32.size)))
    for start, stop in _blocks(x32.size):
        _f32_to_bf16_bits(x32[start:stop], out[start:stop], scratch)
    nan = np.isnan(x32)
    if nan.any():  # rounding can carry a NaN's low payload into the exponent: force a quiet NaN
        out[nan] = (x32[nan].view(np.uint32) >> 16).astype(np.uint16) | np.uint16(0x7FC0)
    return out.reshape(np.shape(x))


def _convert_span(flat: np.ndarray, start: int, stop: int, scratch: _Scratch) -> np.ndarray:
    """flat[start:stop] as float32: a view for float32 sources, converted into scratch.f32 otherwise."""
    block = flat[start:stop]
    if block.dtype == np.float32:
        return block
    dst = scratch.f32[: stop - start]
    if block.dtype == np.float16:
        _f16_bits_to_f32(block.view(np.uint16), dst, scratch, start)
    else:
        with np.errstate(over="ignore"):  # overflow becomes inf, which the codecs refuse
            np.copyto(dst, block, casting="same_kind")
    return dst


def _source_blocks(flat: np.ndarray, scratch: _Scratch) -> Iterator[tuple[int, np.ndarray]]:
    """(offset, float32 block) over a flat source, in blocks of the scratch's size."""
    for start, stop in _blocks(flat.size, scratch.f32.size):
        yield start, _convert_span(flat, start, stop, scratch)


def _to_float32(flat: np.ndarray) -> np.ndarray:
    """A finite float32 copy (or the array itself when it is float32) of a flat source."""
    if flat.dtype == np.float32:
        for start, stop in _blocks(flat.size):
            _check_finite_f32(flat[start:stop], start)
        return flat
    out = np.empty(flat.size, np.float32)
    scratch = _Scratch(min(_BLOCK, max(1, flat.size)))
    for start, block in _source_blocks(flat, scratch):
        _check_finite_f32(block, start)
        out[start : start + block.size] = block
    return out


def _float32_to_f16_array(v: np.ndarray, dtype_out: np.dtype = np.dtype(np.uint16)) -> np.ndarray:
    """A flat float32/float64 source -> float16 bits (uint16), exact RNE, NonFiniteValues out of range."""
    n = v.size
    out = np.empty(n, dtype_out)
    if n == 0:
        return out
    bits = out.view(np.uint16)
    size = min(_BLOCK, n)
    scratch = _Scratch(size)
    segments = np.arange(0, size, _FIXUP_SEGMENT)
    redo: list[np.ndarray] = []
    for start, stop in _blocks(n, size):
        k = stop - start
        block = _convert_span(v, start, stop, scratch)
        segs = segments if k == size else segments[: -(-k // _FIXUP_SEGMENT)]
        flagged = _f32_to_f16_bits(block, bits[start:stop], scratch.u32[:k], segs, start)
        if flagged is not None:
            redo.append(flagged + start)
    if redo:  # float16 subnormals: few values, so numpy's exact (slow) cast is fine for them
        idx = np.concatenate(redo)
        bits[idx] = v[idx].astype(np.float32).astype(np.float16).view(np.uint16)
    return out


def _from_float32(v: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A finite float32 array (owned by the caller) in `dtype`; float16 overflow raises NonFiniteValues."""
    if dtype == np.float32:
        return v
    if dtype == np.float64:
        return v.astype(np.float64)
    return _float32_to_f16_array(v, np.dtype(np.float16))


class Codec(Protocol):
    """How one flat tensor is encoded; `name` and `options()` go into the header."""

    name: ClassVar[str]

    def options(self) -> dict[str, OptionValue]:
        """The codec's options as sent in the header's `codec_opts`."""
        ...

    def encoded_nbytes(self, numel: int) -> int:
        """Exact encoded size of a tensor of `numel` elements, as this codec's encoder produces it."""
        ...

    def accepts_nbytes(self, numel: int, nbytes: int) -> bool:
        """Whether a manifest entry of `numel` elements may occupy `nbytes` on the wire."""
        ...

    def encode(self, x: np.ndarray) -> memoryview:
        """The encoded bytes of x (flat, C order); may share memory with x."""
        ...

    def decode(self, buf: Buffer, numel: int, dtype: DTypeLike = np.float32) -> np.ndarray:
        """A fresh flat array of `numel` finite values in `dtype`; `buf` has an accepted size."""
        ...


def _no_options(name: str, options: Mapping[str, object]) -> None:
    if options:
        raise BadSchema(f"codec {name!r} takes no options, got {sorted(map(str, options))}")


def _check_size(name: str, buf: Buffer, expected: int) -> None:
    if len(buf) != expected:
        raise BadSchema(f"{name} payload of {len(buf)} bytes, expected {expected}")


class _ExactSize:
    """Fixed-size codecs: the manifest size must be exactly what the encoder produces."""

    def encoded_nbytes(self, numel: int) -> int:
        raise NotImplementedError

    def accepts_nbytes(self, numel: int, nbytes: int) -> bool:
        return nbytes == self.encoded_nbytes(numel)


@dataclass(frozen=True)
class Fp32Codec(_ExactSize):
    """float32 values, exact for float32 sources; encoding a float32 array does not copy it."""

    name: ClassVar[str] = "fp32"

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> Fp32Codec:
        _no_options(cls.name, options)
        return cls()

    def options(self) -> dict[str, OptionValue]:
        return {}

    def encoded_nbytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: np.ndarray) -> memoryview:
        return memoryview(_to_float32(_flat_source(x)).view(np.uint8))

    def decode(self, buf: Buffer, numel: int, dtype: DTypeLike = np.float32) -> np.ndarray:
        _check_size(self.name, buf, self.encoded_nbytes(numel))
        src = np.frombuffer(buf, "<f4", count=numel)
        dt = np.dtype(dtype_name(dtype))
        if dt == np.float16:
            return _float32_to_f16_array(src, dt)  # validates range and finiteness blockwise
        out = np.empty(numel, dt)
        for start, stop in _blocks(numel):
            block = src[start:stop]
            _check_finite_f32(block, start)
            out[start:stop] = block
        return out


@dataclass(frozen=True)
class Fp16Codec(_ExactSize):
    """IEEE half precision, round to nearest even; refuses values beyond +-65504."""

    name: ClassVar[str] = "fp16"

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> Fp16Codec:
        _no_options(cls.name, options)
        return cls()

    def options(self) -> dict[str, OptionValue]:
        return {}

    def encoded_nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: np.ndarray) -> memoryview:
        flat = _flat_source(x)
        if flat.dtype == np.float16:
            scratch = _Scratch(min(_BLOCK, max(1, flat.size)))
            for start, stop in _blocks(flat.size):
                _check_f16_bits(flat[start:stop].view(np.uint16), scratch, start)
            return memoryview(flat.view(np.uint8))
        return memoryview(_float32_to_f16_array(flat).view(np.uint8))

    def decode(self, buf: Buffer, numel: int, dtype: DTypeLike = np.float32) -> np.ndarray:
        _check_size(self.name, buf, self.encoded_nbytes(numel))
        bits = np.frombuffer(buf, "<u2", count=numel)
        dt = np.dtype(dtype_name(dtype))
        scratch = _Scratch(min(_BLOCK, max(1, numel)))
        if dt == np.float16:  # the bits are the values: copy them, refusing inf/NaN
            out16 = np.empty(numel, np.float16)
            for start, stop in _blocks(numel):
                _check_f16_bits(bits[start:stop], scratch, start)
                out16.view(np.uint16)[start:stop] = bits[start:stop]
            return out16
        out32 = np.empty(numel, np.float32)
        for start, stop in _blocks(numel):
            _f16_bits_to_f32(bits[start:stop], out32[start:stop], scratch, start)
        return _from_float32(out32, dt)


@dataclass(frozen=True)
class Bf16Codec(_ExactSize):
    """bfloat16: float32's exponent with an 8-bit significand, round to nearest even."""

    name: ClassVar[str] = "bf16"

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> Bf16Codec:
        _no_options(cls.name, options)
        return cls()

    def options(self) -> dict[str, OptionValue]:
        return {}

    def encoded_nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: np.ndarray) -> memoryview:
        flat = _flat_source(x)
        out = np.empty(flat.size, np.uint16)
        scratch = _Scratch(min(_BLOCK, max(1, flat.size)))
        # a float16 tensor decodes back into float16: bfloat16 rounds |x| >= 65408 up to 65536, beyond it
        limit = _BF16_F16_LIMIT if flat.dtype == np.float16 else _BF16_LIMIT
        for start, block in _source_blocks(flat, scratch):
            _check_bf16_range(block, start, limit)
            _f32_to_bf16_bits(block, out[start : start + block.size], scratch)
        return memoryview(out.view(np.uint8))

    def decode(self, buf: Buffer, numel: int, dtype: DTypeLike = np.float32) -> np.ndarray:
        _check_size(self.name, buf, self.encoded_nbytes(numel))
        bits = np.frombuffer(buf, "<u2", count=numel)
        scratch = _Scratch(min(_BLOCK, max(1, numel)))
        out32 = np.empty(numel, np.float32)
        for start, stop in _blocks(numel):
            _bf16_bits_to_f32(bits[start:stop], out32[start:stop], scratch, start)
        return _from_float32(out32, np.dtype(dtype_name(dtype)))


def _int_option(name: str, options: Mapping[str, object], key: str, default: int, lo: int, hi: int) -> int:
    value = options.get(key, default)
    if type(value) is not int or not lo <= value <= hi:
        raise BadSchema(f"codec {name!r} option {key!r} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


@dataclass(frozen=True)
class Int8Codec(_ExactSize):
    """int8 values with one float32 scale (max|x| / 127) per block of `block` elements."""

    block: int = 256
    name: ClassVar[str] = "int8"
    MAX_BLOCK: ClassVar[int] = 1 << 20

    def __post_init__(self) -> None:
        if type(self.block) is not int or not 1 <= self.block <= self.MAX_BLOCK:
            raise ValueError(f"int8 block must be an integer in [1, {self.MAX_BLOCK}], got {self.block!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> Int8Codec:
        unknown = set(options) - {"block"}
        if unknown:
            raise BadSchema(f"codec 'int8' got unknown options {sorted(map(str, unknown))}")
        return cls(block=_int_option(cls.name, options, "block", 256, 1, cls.MAX_BLOCK))

    def options(self) -> dict[str, OptionValue]:
        return {"block": self.block}

    def _nblocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def encoded_nbytes(self, numel: int) -> int:
        return 4 * self._nblocks(numel) + numel

    def encode(self, x: np.ndarray) -> memoryview:
        flat = _flat_source(x)
        n, b = flat.size, self.block
        nblocks = self._nblocks(n)
        out = np.empty(4 * nblocks + n, np.uint8)
        scales = out[: 4 * nblocks].view("<f4")
        values = out[4 * nblocks :].view(np.int8)
        rows_per_pass = max(1, _BLOCK // b)
        scratch = _Scratch(min(rows_per_pass * b, max(1, n)))
        work = np.empty(scratch.f32.size, np.float32)
        full = n // b
        spans = [(r, min(full, r + rows_per_pass)) for r in range(0, full, rows_per_pass)]
        if full < nblocks:
            spans.append((full, nblocks))
        for r0, r1 in spans:
            start, stop = r0 * b, min(n, r1 * b)
            src = _convert_span(flat, start, stop, scratch)
            width = b if r1 * b <= n else stop - start
            self._quantize(
                src.reshape(-1, width),
                scales[r0:r1],
                values[start:stop].reshape(-1, width),
                work[: stop - start].reshape(-1, width),
                start,
            )
        return memoryview(out)

    @staticmethod
    def _quantize(x: np.ndarray, scales: np.ndarray, q: np.ndarray, work: np.ndarray, offset: int) -> None:
        np.abs(x, out=work)
        amax = work.max(axis=1)
        if not np.isfinite(amax).all():
            row = int(np.argmax(~np.isfinite(amax)))
            raise NonFiniteValues(_bad_value_message(x[row], offset + row * x.shape[1], _FLOAT32_MAX, "not finite"))
        live = amax >= _INT8_TINY
        inv = np.zeros_like(amax)
        np.divide(np.float32(127), amax, out=inv, where=live)
        scale = np.zeros_like(amax)
        np.divide(amax, np.float32(127), out=scale, where=live)
        scales[:] = scale
        np.multiply(x, inv[:, None], out=work)
        np.rint(work, out=work)
        np.copyto(q, work, casting="unsafe")

    def decode(self, buf: Buffer, numel: int, dtype: DTypeLike = np.float32) -> np.ndarray:
        _check_size(self.name, buf, self.encoded_nbytes(numel))
        n, b = numel, self.block
        nblocks = self._nblocks(n)
        scales = np.frombuffer(buf, "<f4", count=nblocks)
        if nblocks:
            lo, hi = float(scales.min()), float(scales.max())
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise NonFiniteValues("int8 block scale is not finite")
            if hi > _INT8_MAX_SCALE:
                raise NonFiniteValues(f"int8 block scale {hi!r} would overflow float32")
            if lo < 0:
                raise BadSchema(f"int8 block scale {lo!r} is negative")
        q = np.frombuffer(buf, np.int8, count=n, offset=4 * nblocks)
        out = np.empty(n, np.float32)
        full = n // b
        if full:
            np.multiply(q[: full * b].reshape(full, b), scales[:full, None], out=out[: full * b].reshape(full, b))
        if full < nblocks:
            np.multiply(q[full * b :], scales[full], out=out[full * b :])
        return _from_float32(out, np.dtype(dtype_name(dtype)))


@dataclass(frozen=True)
class TopKCodec:
    """The k = ceil(ratio * n) largest-magnitude entries as (uint32 index, float32 value) pairs."""

    ratio: float
    name: ClassVar[str] = "topk"
    MAX_NUMEL: ClassVar[int] = 1 << 32  # indices are uint32

    def __post_init__(self) -> None:
        r = self.ratio
        if type(r) not in (int, float) or not (math.isfinite(r) and 0 < r <= 1):
            raise ValueError(f"top-k ratio must be a number in (0, 1], got {r!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> TopKCodec:
        unknown = set(options) - {"ratio"}
        if unknown:
            raise BadSchema(f"codec 'topk' got unknown options {sorted(map(str, unknown))}")
        if "ratio" not in options:
            raise BadSchema("codec 'topk' needs option 'ratio'")
        ratio = options["ratio"]
        if type(ratio) not in (int, float) or not (math.isfinite(ratio) and 0 < ratio <= 1):
            raise BadSchema(f"codec 'topk' option 'ratio' must be a number in (0, 1], got {ratio!r}")
        return cls(ratio=float(ratio))

    def options(self) -> dict[str, OptionValue]:
        return {"ratio": float(self.ratio)}

    def k(self, numel: int) -> int:
        """How many entries the encoder sends for a tensor of `numel` elements."""
        if numel == 0:
            return 0
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def encoded_nbytes(self, numel: int) -> int:
        return 8 * self.k(numel)

    def accepts_nbytes(self, numel: int, nbytes: int) -> bool:
        return numel <= self.MAX_NUMEL and nbytes % 8 == 0 and nbytes // 8 <= numel

    def encode(self, x: np.ndarray) -> memoryview:
        flat = _flat_source(x)
        n = flat.size
        if n > self.MAX_NUMEL:
            raise ValueError(f"top-k indices are uint32: at most 2^32 elements, got {n}")
        v = _to_float32(flat)
        k = self.k(n)
        out = np.empty(8 * k, np.uint8)
        if k == n:
            idx = np.arange(n, dtype=np.uint32)
        elif k:
            idx = np.argpartition(np.abs(v), n - k)[n - k :]
            idx.sort()
        else:
            idx = np.empty(0, np.uint32)
        out[: 4 * k].view("<u4")[:] = idx
        out[4 * k :].view("<f4")[:] = v[idx]
        return memoryview(out)

    def decode(self, buf: Buffer, numel: int, dtype: DTypeLike = np.float32) -> np.ndarray:
        if not self.accepts_nbytes(numel, len(buf)):
            raise BadSchema(f"top-k payload of {len(buf)} bytes does not fit {numel} elements")
        k = len(buf) // 8
        idx = np.frombuffer(buf, "<u4", count=k)
        vals = np.frombuffer(buf, "<f4", count=k, offset=4 * k)
        if k:
            if int(idx[-1]) >= numel:
                raise BadSchema(f"top-k index {int(idx[-1])} out of range for {numel} elements")
            if k > 1 and not bool(np.all(idx[1:] > idx[:-1])):
                raise BadSchema("top-k indices are not strictly increasing")
            _check_finite_f32(vals, 0)
        out = np.zeros(numel, np.float32)
        out[idx] = vals
        return _from_float32(out, np.dtype(dtype_name(dtype)))


CODEC_TYPES: Mapping[str, type[Fp32Codec | Fp16Codec | Bf16Codec | Int8Codec | TopKCodec]] = MappingProxyType(
    {cls.name: cls for cls in (Fp32Codec, Fp16Codec, Bf16Codec, Int8Codec, TopKCodec)}
)


def codec_from_wire(name: str, options: Mapping[str, object]) -> Codec:
    """The codec a header names; UnknownCodec for an unknown name, BadSchema for bad options."""
    cls = CODEC_TYPES.get(name)
    if cls is None:
        raise UnknownCodec(f"unknown codec {name!r} (known: {', '.join(CODEC_TYPES)})")
    return cls.from_options(options)


def get_codec(name: str, **options: OptionValue) -> Codec:
    """A codec from local configuration, e.g. get_codec("fp16"), get_codec("int8", block=128),
    get_codec("topk", ratio=0.01); ValueError for an unknown name or bad options.

    (A codec named by a peer's header goes through `codec_from_wire`, which raises WireErrors.)
    """
    cls = CODEC_TYPES.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r}: choose one of {', '.join(CODEC_TYPES)}")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for codec {name!r}: {exc}") from None


class ErrorFeedback:
    """The sender's memory of what top-k left out: one residual per tensor name.

    Each step sends top-k of (x + residual) and keeps the rest as the new residual, so over many
    steps everything is sent eventually: the sum of what was sent plus the residual equals the sum
    of the inputs. `compress` returns exactly what the receiver will decode (same dtype and shape);
    pass those arrays to `encode_message` with the same `TopKCodec`.
    """

    def __init__(self, codec: TopKCodec) -> None:
        self.codec = codec
        self._residuals: dict[str, np.ndarray] = {}

    def compress(self, name: str, x: np.ndarray) -> np.ndarray:
        flat = _flat_source(x)
        work = np.float64 if flat.dtype == np.float64 else np.float32
        v = flat.astype(work)
        residual = self._residuals.get(name)
        if residual is not None:
            if residual.size != v.size:
                raise ValueError(f"tensor {name!r} has {v.size} elements, its residual {residual.size}")
            v += residual
        sent32 = self.codec.decode(self.codec.encode(v), v.size)  # what the wire will carry
        sent = _from_float32(sent32, flat.dtype)  # the receiver's cast into the tensor's dtype
        self._residuals[name] = v - sent.astype(work)
        return sent.reshape(np.shape(x))

    def residual(self, name: str) -> np.ndarray | None:
        """What has not been sent yet for `name` (flat), or None before its first step."""
        return self._residuals.get(name)

    def reset(self, name: str | None = None) -> None:
        """Forget the residual of one tensor, or of all of them."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)
