"""The blockwise int8 codec: one float32 scale (max|x| / 127) per block, then int8 values."""

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
)
from gossip.codecs.kernels import (
    _BLOCK,
    _FLOAT32_MAX,
    _bad_value_message,
    _convert_span,
    _flat_source,
    _from_float32,
    _run_spans,
    _Scratch,
    dtype_name,
)
from gossip.errors import BadSchema, NonFiniteValues

_INT8_TINY = np.float32(2.0**-100)
_INT8_MAX_SCALE = _FLOAT32_MAX / 128  # larger scales could overflow float32 on decode


@dataclass(frozen=True)
class Int8Codec(_ExactSize):
    """int8 values with one float32 scale (max|x| / 127) per block of `block` elements."""

    block: int = 256
    name: ClassVar[str] = "int8"
    MAX_BLOCK: ClassVar[int] = 1 << 20

    def __post_init__(self) -> None:
        if not _is_int_in(self.block, 1, self.MAX_BLOCK):
            raise ValueError(f"int8 block must be an integer in [1, {self.MAX_BLOCK}], got {self.block!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> Int8Codec:
        _check_known_options(cls.name, options, ("block",))
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
        return out.data

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
