"""The numeric kernels the codecs share: flat float sources, block and thread spans, range and
finiteness checks, and the float16/bfloat16 casts.

fp16 conversions use torch's vectorised float16 cast (numpy's is a scalar loop, several times slower
than a memory copy; torch is imported on first use); bf16 conversions are integer bit operations on
cache-sized blocks. Large arrays are converted in contiguous spans on parallel threads when cores are
idle (numpy releases the GIL inside its loops); the bytes are the same as a single-threaded run, and
an error names the first bad element, as a sequential run would.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

import numpy as np
from numpy.typing import DTypeLike

from gossip.errors import NonFiniteValues

if sys.byteorder != "little":  # the bit-level views below read the wire's little-endian bytes natively
    raise ImportError("gossip.codecs needs a little-endian host")

WIRE_DTYPES: Mapping[str, np.dtype] = MappingProxyType(
    {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "float64": np.dtype(np.float64)}
)

_WIRE_DTYPE_SET = frozenset(WIRE_DTYPES.values())


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
    waits for the slowest span), which is slower than one thread.
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
    per_part = -(-n // parts)  # ceiling divisions: spans of whole `align` units cover [0, n)
    step = -(-per_part // align) * align
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


def _float32_to_f16_array(v: np.ndarray, dtype_out: DTypeLike = np.uint16) -> np.ndarray:
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
