"""The SparseLoCo codec for pseudo-gradients: top-k within each fixed-size chunk, the kept values in a few
bits (a sign and a magnitude level) under a per-chunk scale, their in-chunk offsets Elias-Fano coded.

Sound only on differences summed over time (DiLoCo's pseudo-gradients), with `ErrorFeedback` carrying what
each message leaves out; never on whole parameters (anchors)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from numpy.typing import DTypeLike

from gossip.codecs.base import (
    Buffer,
    OptionValue,
    _check_known_options,
    _check_size,
    _ExactSize,
    _int_option,
    _is_int_in,
    _is_ratio,
    _ratio_option,
)
from gossip.codecs.kernels import _flat_source, _from_float32, _to_float32, dtype_name
from gossip.errors import BadSchema, NonFiniteValues

DEFAULT_SPARSELOCO_RATIO = 0.02
DEFAULT_SPARSELOCO_CHUNK = 4096
DEFAULT_SPARSELOCO_BITS = 2


@dataclass(frozen=True)
class _Shape:
    """The layout of one run of chunks of equal length `size` (all but the last, or the last alone)."""

    rows: int  # chunks in the run
    size: int  # elements per chunk
    k: int  # entries kept per chunk
    low: int  # Elias-Fano low bits per offset
    high: int  # bits of the unary high parts per chunk

    @classmethod
    def of(cls, rows: int, size: int, ratio: float) -> _Shape:
        k = min(size, max(1, math.ceil(ratio * size))) if size else 0
        # Elias-Fano's split: each offset keeps its low floor(log2(size / k)) bits apart
        low = max(0, (size // k).bit_length() - 1) if k else 0
        high = k + ((size - 1) >> low) + 1 if size else 0
        return cls(rows, size, k, low, high)

    @property
    def index_bits(self) -> int:
        return self.rows * (self.high + self.k * self.low)


@dataclass(frozen=True)
class SparseLoCoCodec(_ExactSize):
    """Per chunk of `chunk` elements, the k = ceil(ratio * chunk) largest-magnitude entries (the last, shorter
    chunk keeps ceil(ratio * its length)), each as its in-chunk offset (Elias-Fano: about 2 + log2(1/ratio) bits)
    and a `bits`-bit value: a sign bit and one of 2^(bits-1) magnitude levels (l + 1) / 2^(bits-1) of the
    chunk's float32 scale, the largest kept magnitude. Layout: the chunks' scales (float32 each), then the
    index bits of every chunk, then the value bits, each section packed little-endian bit order. The size
    is fixed by (numel, ratio, chunk, bits). Values are rounded hard: use it with error feedback."""

    ratio: float = DEFAULT_SPARSELOCO_RATIO
    chunk: int = DEFAULT_SPARSELOCO_CHUNK
    bits: int = DEFAULT_SPARSELOCO_BITS
    name: ClassVar[str] = "sparseloco"
    MAX_CHUNK: ClassVar[int] = 1 << 20
    MAX_BITS: ClassVar[int] = 8

    def __post_init__(self) -> None:
        if not _is_ratio(self.ratio):
            raise ValueError(f"sparseloco ratio must be a number in (0, 1], got {self.ratio!r}")
        if not _is_int_in(self.chunk, 1, self.MAX_CHUNK):
            raise ValueError(f"sparseloco chunk must be an integer in [1, {self.MAX_CHUNK}], got {self.chunk!r}")
        if not _is_int_in(self.bits, 1, self.MAX_BITS):
            raise ValueError(f"sparseloco bits must be an integer in [1, {self.MAX_BITS}], got {self.bits!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> SparseLoCoCodec:
        _check_known_options(cls.name, options, ("ratio", "chunk", "bits"))
        ratio = _ratio_option(cls.name, options)
        chunk = _int_option(cls.name, options, "chunk", DEFAULT_SPARSELOCO_CHUNK, 1, cls.MAX_CHUNK)
        bits = _int_option(cls.name, options, "bits", DEFAULT_SPARSELOCO_BITS, 1, cls.MAX_BITS)
        return cls(ratio=ratio, chunk=chunk, bits=bits)

    def options(self) -> dict[str, OptionValue]:
        return {"ratio": float(self.ratio), "chunk": self.chunk, "bits": self.bits}

    def _runs(self, numel: int) -> tuple[_Shape, _Shape]:
        """The full chunks, then the last, shorter one (rows 0 when there is none)."""
        full, rest = divmod(numel, self.chunk)
        return _Shape.of(full, self.chunk, self.ratio), _Shape.of(1 if rest else 0, rest, self.ratio)

    def k(self, numel: int) -> int:
        """How many entries the encoder sends for a tensor of `numel` elements (every chunk's k, summed)."""
        return sum(run.rows * run.k for run in self._runs(numel))

    def encoded_nbytes(self, numel: int) -> int:
        runs = self._runs(numel)
        chunks = sum(run.rows for run in runs)
        index_bits = sum(run.index_bits for run in runs)
        return 4 * chunks + (index_bits + 7) // 8 + (self.k(numel) * self.bits + 7) // 8

    def encode(self, x: np.ndarray) -> memoryview:
        v = _to_float32(_flat_source(x))
        n = v.size
        runs = self._runs(n)
        out = np.zeros(self.encoded_nbytes(n), np.uint8)
        scales, index_bits, codes = [], [], []
        start = 0
        for run in runs:
            if run.rows:
                rows = v[start : start + run.rows * run.size].reshape(run.rows, run.size)
                start += run.rows * run.size
                idx, kept = _top_k_rows(rows, run.k)
                scale, code = _quantize(kept, self.bits)
                scales.append(scale)
                index_bits.append(_elias_fano_bits(idx, run))
                codes.append(code)
        chunks = sum(run.rows for run in runs)
        out[: 4 * chunks].view("<f4")[:] = np.concatenate(scales) if scales else np.empty(0, np.float32)
        at = 4 * chunks
        ibits = np.concatenate(index_bits) if index_bits else np.empty(0, np.uint8)
        packed = np.packbits(ibits, bitorder="little")
        out[at : at + packed.size] = packed
        at += packed.size
        all_codes = np.concatenate(codes) if codes else np.empty(0, np.uint8)
        vbits = ((all_codes[:, None] >> np.arange(self.bits, dtype=np.uint8)) & 1).astype(np.uint8).ravel()
        vpacked = np.packbits(vbits, bitorder="little")
        out[at : at + vpacked.size] = vpacked
        return out.data

    def decode(self, buf: Buffer, numel: int, dtype: DTypeLike = np.float32) -> np.ndarray:
        _check_size(self.name, buf, self.encoded_nbytes(numel))
        runs = self._runs(numel)
        chunks = sum(run.rows for run in runs)
        scales = np.frombuffer(buf, "<f4", count=chunks)
        if chunks:
            lo, hi = float(scales.min()), float(scales.max())
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise NonFiniteValues("sparseloco chunk scale is not finite")
            if lo < 0:
                raise BadSchema(f"sparseloco chunk scale {lo!r} is negative")
        raw = np.frombuffer(buf, np.uint8)
        index_bytes = (sum(run.index_bits for run in runs) + 7) // 8
        ibits = np.unpackbits(raw[4 * chunks : 4 * chunks + index_bytes], bitorder="little")
        total_k = self.k(numel)
        vbits = np.unpackbits(raw[4 * chunks + index_bytes :], bitorder="little")[: total_k * self.bits]
        codes = vbits.reshape(total_k, self.bits) @ (1 << np.arange(self.bits, dtype=np.int64)) if total_k else None
        out = np.zeros(numel, np.float32)
        start = bit_at = value_at = chunk_at = 0
        for run in runs:
            if not run.rows:
                continue
            idx = _elias_fano_offsets(ibits[bit_at : bit_at + run.index_bits], run)
            bit_at += run.index_bits
            assert codes is not None  # rows with k >= 1 entries each
            run_codes = codes[value_at : value_at + run.rows * run.k].reshape(run.rows, run.k)
            value_at += run.rows * run.k
            values = _dequantize(run_codes, scales[chunk_at : chunk_at + run.rows], self.bits)
            chunk_at += run.rows
            region = out[start : start + run.rows * run.size].reshape(run.rows, run.size)
            np.put_along_axis(region, idx, values, axis=1)
            start += run.rows * run.size
        return _from_float32(out, np.dtype(dtype_name(dtype)))


def _top_k_rows(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k largest-magnitude entries: their offsets (sorted, int64) and their values."""
    size = rows.shape[1]
    if k == size:
        idx = np.broadcast_to(np.arange(size, dtype=np.int64), rows.shape).copy()
    else:
        idx = np.argpartition(np.abs(rows), size - k, axis=1)[:, size - k :].astype(np.int64)
        idx.sort(axis=1)
    return idx, np.take_along_axis(rows, idx, axis=1)


def _quantize(kept: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row the scale (its largest |value|, float32) and each value's code: its sign in the top bit and
    the magnitude level l (|value| ~ (l + 1) / L of the scale, L = 2^(bits - 1)) below it, flattened."""
    levels = 1 << (bits - 1)
    mag = np.abs(kept)
    scale = mag.max(axis=1).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    level = np.clip(np.rint(mag / safe[:, None] * levels) - 1, 0, levels - 1).astype(np.uint8)
    sign = (kept < 0).astype(np.uint8)
    return scale, ((sign << (bits - 1)) | level).ravel()


def _dequantize(codes: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    levels = 1 << (bits - 1)
    level = (codes & (levels - 1)).astype(np.float32) + 1
    sign = np.where(codes >> (bits - 1) & 1, np.float32(-1), np.float32(1))
    # (l + 1) / L <= 1: a decoded value never exceeds its finite float32 scale
    values: np.ndarray = sign * (level / np.float32(levels)) * scales[:, None]
    return values


def _elias_fano_bits(idx: np.ndarray, run: _Shape) -> np.ndarray:
    """Each row's sorted offsets as its unary high parts then its low bits, the rows one after another."""
    rows, k, low = run.rows, run.k, run.low
    unary = np.zeros((rows, run.high), np.uint8)
    np.put_along_axis(unary, (idx >> low) + np.arange(k), 1, axis=1)  # the i-th set bit sits at high part + i
    if not low:
        return unary.ravel()
    low_bits = ((idx[:, :, None] >> np.arange(low)) & 1).astype(np.uint8).reshape(rows, k * low)
    bits: np.ndarray = np.concatenate([unary, low_bits], axis=1).ravel()
    return bits


def _elias_fano_offsets(bits: np.ndarray, run: _Shape) -> np.ndarray:
    """The (rows, k) in-chunk offsets a run's index bits describe; BadSchema unless each row holds k strictly
    increasing offsets below the chunk's size."""
    rows, k, low = run.rows, run.k, run.low
    per_row = bits.reshape(rows, run.high + k * low)
    unary = per_row[:, : run.high]
    counts = np.count_nonzero(unary, axis=1)
    if bool(np.any(counts != k)):
        bad = int(np.argmax(counts != k))
        raise BadSchema(f"sparseloco chunk {bad} holds {int(counts[bad])} offsets, expected {k}")
    ones = np.nonzero(unary)[1].reshape(rows, k)  # row-major: sorted within each row
    idx = (ones - np.arange(k)) << low
    if low:
        idx |= per_row[:, run.high :].reshape(rows, k, low).astype(np.int64) @ (np.int64(1) << np.arange(low))
    if bool(np.any(idx >= run.size)):
        raise BadSchema(f"sparseloco offset {int(idx.max())} out of range for chunks of {run.size} elements")
    if k > 1 and not bool(np.all(idx[:, 1:] > idx[:, :-1])):
        raise BadSchema("sparseloco offsets are not strictly increasing within a chunk")
    return idx
