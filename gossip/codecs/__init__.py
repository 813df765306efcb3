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

fp16 conversions use torch's vectorised float16 cast (numpy's is a scalar loop, several times slower
than a memory copy; torch is imported on first use); bf16 conversions are integer bit operations on
cache-sized blocks. Arrays of millions of elements are converted in contiguous spans on up to 4
threads when cores are idle (numpy releases the GIL inside its loops); the bytes are the same as a
single-threaded run, and an error names the first bad element, as a sequential run would. fp32, fp16 and bf16 are `ElementwiseCodec`s: any run of
whole elements decodes on its own (`decode_into`), which lets the wire decoder decode a tensor
chunk by chunk as it arrives.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
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

_WIRE_DTYPE_SET = frozenset(WIRE_DTYPES.values())

Buffer = bytes | bytearray | memoryview
OptionValue = int | float

_BLOCK = 1 << 16  # elements per cache-sized block in the blockwise conversions (256 KiB of float32)
# Large arrays are converted in spans on parallel threads (numpy releases the GIL inside its loops):
# at most this many threads, each with at least _PARALLEL_MIN elements, so starting one stays cheap.
_MAX_THREADS = 4
_PARALLEL_MIN = 1 << 20
_F16_BLOCK = 1 << 18  # elements per block in the fp16 casts: torch's per-call cost spreads over more elements
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _const(value: float, dtype: DTypeLike) -> np.ndarray:
    # read-only 0-d arrays: ufuncs take them with less per-call overhead than numpy scalars
    arr = np.array(value, dtype)
    arr.flags.writeable = False
    return arr


_U32_1 = _const(1, np.uint32)
_U32_16 = _const(16, np.uint32)
_U16_ABS = _const(0x7FFF, np.uint16)
_F16_MAX = 65504.0  # the largest finite float16
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


def _thread_budget() -> int:
    """Threads worth using now: this one plus the cores the 1-minute load average leaves idle.

    On a machine whose cores are all busy, a second thread only waits for a core (and the join
    waits for the slowest span), which measured slower than one thread on the shared 2-core box.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        idle = cpus - os.getloadavg()[0]
    except OSError:  # no load average to be had
        idle = cpus - 1
    return max(1, min(cpus, 1 + int(idle)))


def _run_spans(n: int, work: Callable[[int, int], None], align: int = 1) -> None:
    """work(start, stop) over contiguous spans covering [0, n): one span for small n or a busy machine,
    else one per thread.

    Span boundaries are multiples of `align`. Every span finishes before this returns; then the
    exception of the first failing span in index order (the one a sequential run would raise) is raised.
    """
    parts = min(_MAX_THREADS, n // _PARALLEL_MIN)
    if parts >= 2:
        parts = min(parts, _thread_budget())
    if parts < 2:
        work(0, n)
        return
    step = -(-(-(-n // parts)) // align) * align
    spans = [(start, min(n, start + step)) for start in range(0, n, step)]
    errors: list[BaseException | None] = [None] * len(spans)

    def run(i: int) -> None:
        try:
            work(*spans[i])
        except BaseException as exc:  # re-raised below, after every span has finished
            errors[i] = exc

    threads: list[threading.Thread] = []
    for i in range(1, len(spans)):
        thread = threading.Thread(target=run, args=(i,), name=f"murmur-codec-{i}", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: do that span here
            run(i)
        else:
            threads.append(thread)
    run(0)
    for thread in threads:
        thread.join()
    for exc in errors:
        if exc is not None:
            raise exc


def _bad_value_message(values: np.ndarray, offset: int, limit: float, what: str) -> str:
    bad = np.flatnonzero(~(np.abs(values.astype(np.float64)) <= limit))
    i = int(bad[0]) if bad.size else 0
    return f"element {offset + i} is {float(values[i])!r}: {what}"


def _check_finite_f32(block: np.ndarray, offset: int) -> None:
    # min/max propagate NaN and expose +-inf, and read the block without writing a temporary
    if block.size and not (np.isfinite(block.min()) and np.isfinite(block.max())):
        raise NonFiniteValues(_bad_value_message(block, offset, _FLOAT32_MAX, "not finite"))


class _Scratch:
    """Per-call (per-thread) work buffers for the blockwise conversions, one block each."""

    def __init__(self, n: int, cap: int = _BLOCK) -> None:
        size = min(cap, max(1, n))
        self.f32 = np.empty(size, np.float32)
        self.u32 = np.empty(size, np.uint32)
        self.u16 = np.empty(size, np.uint16)


def _check_f16_bits(bits: np.ndarray, scratch: _Scratch, offset: int) -> None:
    """NonFiniteValues if any float16 (given as uint16 bits) is an infinity or NaN."""
    mag = np.bitwise_and(bits, _U16_ABS, scratch.u16[: bits.size])
    if mag.size and mag.max() >= 0x7C00:
        i = int(np.argmax(mag >= 0x7C00))
        raise NonFiniteValues(f"element {offset + i} is a float16 infinity or NaN")


def _torch_cast(src: np.ndarray, dst: np.ndarray, spare: np.ndarray) -> None:
    """dst[:] = src converted by torch's vectorised cast (float16 <-> float32, round to nearest even).

    numpy's float16 cast is a scalar loop several times slower than a memory copy; torch's is one
    vectorised pass. torch takes only writable arrays without a warning, so a read-only `src` (bytes
    off the wire) is first copied into `spare`, a scratch array of its dtype, while it is in cache.
    """
    import torch

    if not src.flags.writeable:
        spare = spare[: src.size]
        np.copyto(spare, src)
        src = spare
    torch.from_numpy(dst).copy_(torch.from_numpy(src))


def _f16_bits_to_f32(h: np.ndarray, out: np.ndarray, scratch: _Scratch, offset: int) -> None:
    """float16 bits (uint16) -> float32 `out`, exact; NonFiniteValues for inf/NaN halves."""
    if h.size == 0:
        return
    _torch_cast(h.view(np.float16), out, scratch.u16.view(np.float16))
    # an infinity or NaN half stays one in float32, and min/max propagate NaN
    if not (np.isfinite(out.min()) and np.isfinite(out.max())):
        i = int(np.argmax(~np.isfinite(out)))
        raise NonFiniteValues(f"element {offset + i} is a float16 infinity or NaN")


def _f32_to_f16_block(x: np.ndarray, out: np.ndarray, scratch: _Scratch, offset: int) -> None:
    """float32 block -> float16 bits in `out`, round to nearest even; NonFiniteValues for NaN, inf, |x| > 65504."""
    if x.size == 0:
        return
    # comparisons with NaN are false, so NaN fails this test too
    if not (x.min() >= -_F16_MAX and x.max() <= _F16_MAX):
        raise NonFiniteValues(_bad_value_message(x, offset, _F16_MAX, "outside float16's range of +-65504"))
    _torch_cast(x, out.view(np.float16), scratch.f32)


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
    scratch = _Scratch(x32.size)
    for start, stop in _blocks(x32.size):
        _f32_to_bf16_bits(x32[start:stop], out[start:stop], scratch)
    nan = np.isnan(x32)
    if nan.any():  # rounding can carry a NaN's low payload into the exponent: force a quiet NaN
        out[nan] = (x32[nan].view(np.uint32) >> 16).astype(np.uint16) | np.uint16(0x7FC0)
    return out.reshape(np.shape(x))


def _convert_span(flat: np.ndarray, start: int, stop: int, scratch: _Scratch, offset: int = 0) -> np.ndarray:
    """flat[start:stop] as float32: a view for float32 sources, converted into scratch.f32 otherwise.

    `offset` is flat[0]'s index in its tensor, for error messages."""
    block = flat[start:stop]
    if block.dtype == np.float32:
        return block
    dst = scratch.f32[: stop - start]
    if block.dtype == np.float16:
        _f16_bits_to_f32(block.view(np.uint16), dst, scratch, offset + start)
    else:
        with np.errstate(over="ignore"):  # overflow becomes inf, which the codecs refuse
            np.copyto(dst, block, casting="same_kind")
    return dst


def _source_blocks(flat: np.ndarray, scratch: _Scratch, offset: int = 0) -> Iterator[tuple[int, np.ndarray]]:
    """(start, float32 block) over a flat source, in blocks of the scratch's size."""
    for start, stop in _blocks(flat.size, scratch.f32.size):
        yield start, _convert_span(flat, start, stop, scratch, offset)


def _to_float32(flat: np.ndarray) -> np.ndarray:
    """A finite float32 copy (or the array itself when it is float32) of a flat source."""
    if flat.dtype == np.float32:

        def check(lo: int, hi: int) -> None:
            for start, stop in _blocks(hi - lo):
                _check_finite_f32(flat[lo + start : lo + stop], lo + start)

        _run_spans(flat.size, check)
        return flat
    out = np.empty(flat.size, np.float32)

    def convert(lo: int, hi: int) -> None:
        scratch = _Scratch(hi - lo)
        for start, block in _source_blocks(flat[lo:hi], scratch, lo):
            _check_finite_f32(block, lo + start)
            out[lo + start : lo + start + block.size] = block

    _run_spans(flat.size, convert)
    return out


def _f32_to_f16_span(src: np.ndarray, bits: np.ndarray, offset: int) -> None:
    """A flat float32/float64 span -> float16 bits (uint16) in `bits`; `offset` is src[0]'s index."""
    scratch = _Scratch(src.size, cap=_F16_BLOCK)
    for start, block in _source_blocks(src, scratch, offset):
        _f32_to_f16_block(block, bits[start : start + block.size], scratch, offset + start)


def _float32_to_f16_array(v: np.ndarray, dtype_out: np.dtype = np.dtype(np.uint16)) -> np.ndarray:
    """A flat float32/float64 source -> float16 bits (uint16), exact RNE, NonFiniteValues out of range."""
    out = np.empty(v.size, dtype_out)
    bits = out.view(np.uint16)
    _run_spans(v.size, lambda lo, hi: _f32_to_f16_span(v[lo:hi], bits[lo:hi], lo))
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


class ElementwiseCodec(_ExactSize):
    """A codec that encodes every element on its own in `element_nbytes` bytes (fp32, fp16, bf16).

    Any run of whole elements then decodes on its own, so a receiver can decode a tensor piece by
    piece as its bytes arrive, straight into the output array (`decode_into`).
    """

    name: ClassVar[str]
    element_nbytes: ClassVar[int]

    def encoded_nbytes(self, numel: int) -> int:
        return self.element_nbytes * numel

    def decode(self, buf: Buffer, numel: int, dtype: DTypeLike = np.float32) -> np.ndarray:
        _check_size(self.name, buf, self.encoded_nbytes(numel))
        out = np.empty(numel, np.dtype(dtype_name(dtype)))
        self.decode_into(buf, out)
        return out

    def decode_into(self, buf: Buffer, out: np.ndarray, offset: int = 0) -> None:
        """Decode the elements in `buf` into `out`, a flat writable array of a wire dtype and of exactly
        len(buf) / element_nbytes elements; `offset` is out[0]'s index in its tensor (error messages
        name elements by that index). Raises what `decode` raises, leaving `out` partly written."""
        if out.ndim != 1 or len(buf) != self.element_nbytes * out.size:
            raise ValueError(f"{len(buf)} {self.name} bytes do not fill {out.size} elements")
        if out.dtype not in _WIRE_DTYPE_SET:
            dtype_name(out.dtype)  # raises TypeError, naming the dtype
        if out.size == 0:
            return
        view = memoryview(buf).cast("B")
        k = self.element_nbytes
        _run_spans(out.size, lambda lo, hi: self._decode_span(view[lo * k : hi * k], out[lo:hi], offset + lo))

    def _decode_span(self, buf: memoryview, out: np.ndarray, offset: int) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Fp32Codec(ElementwiseCodec):
    """float32 values, exact for float32 sources; encoding a float32 array does not copy it."""

    name: ClassVar[str] = "fp32"
    element_nbytes: ClassVar[int] = 4

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> Fp32Codec:
        _no_options(cls.name, options)
        return cls()

    def options(self) -> dict[str, OptionValue]:
        return {}

    def encode(self, x: np.ndarray) -> memoryview:
        return memoryview(_to_float32(_flat_source(x)).view(np.uint8))

    def _decode_span(self, buf: memoryview, out: np.ndarray, offset: int) -> None:
        src = np.frombuffer(buf, "<f4")
        if out.dtype == np.float16:
            _f32_to_f16_span(src, out.view(np.uint16), offset)  # validates range and finiteness
            return
        for start, stop in _blocks(src.size):
            block = src[start:stop]
            _check_finite_f32(block, offset + start)
            out[start:stop] = block


@dataclass(frozen=True)
class Fp16Codec(ElementwiseCodec):
    """IEEE half precision, round to nearest even; refuses values beyond +-65504."""

    name: ClassVar[str] = "fp16"
    element_nbytes: ClassVar[int] = 2

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> Fp16Codec:
        _no_options(cls.name, options)
        return cls()

    def options(self) -> dict[str, OptionValue]:
        return {}

    def encode(self, x: np.ndarray) -> memoryview:
        flat = _flat_source(x)
        if flat.dtype == np.float16:
            bits = flat.view(np.uint16)

            def check(lo: int, hi: int) -> None:
                scratch = _Scratch(hi - lo)
                for start, stop in _blocks(hi - lo):
                    _check_f16_bits(bits[lo + start : lo + stop], scratch, lo + start)

            _run_spans(flat.size, check)
            return memoryview(flat.view(np.uint8))
        return memoryview(_float32_to_f16_array(flat).view(np.uint8))

    def _decode_span(self, buf: memoryview, out: np.ndarray, offset: int) -> None:
        bits = np.frombuffer(buf, "<u2")
        scratch = _Scratch(bits.size, cap=_F16_BLOCK)
        for start, stop in _blocks(bits.size, _F16_BLOCK):
            h = bits[start:stop]
            if out.dtype == np.float16:  # the bits are the values: copy them, refusing inf/NaN
                _check_f16_bits(h, scratch, offset + start)
                out.view(np.uint16)[start:stop] = h
            elif out.dtype == np.float32:
                _f16_bits_to_f32(h, out[start:stop], scratch, offset + start)
            else:
                dst = scratch.f32[: stop - start]
                _f16_bits_to_f32(h, dst, scratch, offset + start)
                out[start:stop] = dst


@dataclass(frozen=True)
class Bf16Codec(ElementwiseCodec):
    """bfloat16: float32's exponent with an 8-bit significand, round to nearest even."""

    name: ClassVar[str] = "bf16"
    element_nbytes: ClassVar[int] = 2

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> Bf16Codec:
        _no_options(cls.name, options)
        return cls()

    def options(self) -> dict[str, OptionValue]:
        return {}

    def encode(self, x: np.ndarray) -> memoryview:
        flat = _flat_source(x)
        out = np.empty(flat.size, np.uint16)
        # a float16 tensor decodes back into float16: bfloat16 rounds |x| >= 65408 up to 65536, beyond it
        limit = _BF16_F16_LIMIT if flat.dtype == np.float16 else _BF16_LIMIT

        def convert(lo: int, hi: int) -> None:
            scratch = _Scratch(hi - lo)
            for start, block in _source_blocks(flat[lo:hi], scratch, lo):
                _check_bf16_range(block, lo + start, limit)
                _f32_to_bf16_bits(block, out[lo + start : lo + start + block.size], scratch)

        _run_spans(flat.size, convert)
        return memoryview(out.view(np.uint8))

    def _decode_span(self, buf: memoryview, out: np.ndarray, offset: int) -> None:
        bits = np.frombuffer(buf, "<u2")
        scratch = _Scratch(bits.size, cap=_F16_BLOCK)
        for start, stop in _blocks(bits.size, _F16_BLOCK):
            if out.dtype == np.float32:
                _bf16_bits_to_f32(bits[start:stop], out[start:stop], scratch, offset + start)
                continue
            dst = scratch.f32[: stop - start]
            _bf16_bits_to_f32(bits[start:stop], dst, scratch, offset + start)
            if out.dtype == np.float16:  # bfloat16 reaches beyond float16's range: checked here
                _f32_to_f16_block(dst, out.view(np.uint16)[start:stop], scratch, offset + start)
            else:
                out[start:stop] = dst


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
        pass_size = max(1, _BLOCK // b) * b  # whole rows (blocks of b) per pass

        def quantize_rows(lo: int, hi: int) -> None:  # lo is a multiple of b
            scratch = _Scratch(hi - lo, cap=pass_size)
            work = np.empty(scratch.f32.size, np.float32)
            for start in range(lo, hi, pass_size):
                stop = min(hi, start + pass_size)
                src = _convert_span(flat, start, stop, scratch)
                full_stop = start + (stop - start) // b * b
                for r_start, r_stop, width in ((start, full_stop, b), (full_stop, stop, stop - full_stop)):
                    if r_stop > r_start:  # the full rows, then a last short row
                        self._quantize(
                            src[r_start - start : r_stop - start].reshape(-1, width),
                            scales[r_start // b : -(-r_stop // b)],
                            values[r_start:r_stop].reshape(-1, width),
                            work[: r_stop - r_start].reshape(-1, width),
                            r_start,
                        )

        _run_spans(n, quantize_rows, align=b)
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

        def dequantize(lo: int, hi: int) -> None:  # lo is a multiple of b
            full_hi = lo + (hi - lo) // b * b
            rows = (full_hi - lo) // b
            if rows:
                np.multiply(q[lo:full_hi].reshape(rows, b), scales[lo // b : lo // b + rows, None],
                            out=out[lo:full_hi].reshape(rows, b))
            if full_hi < hi:
                np.multiply(q[full_hi:hi], scales[full_hi // b], out=out[full_hi:hi])

        _run_spans(n, dequantize, align=b)
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
