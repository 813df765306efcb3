"""The float codecs (fp32, fp16, bf16): every element on its own in a fixed number of bytes, so a
tensor can be decoded piece by piece as its bytes arrive."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from numpy.typing import DTypeLike

from gossip.codecs.base import Buffer, _check_size, _ExactSize, _NoOptions
from gossip.codecs.kernels import (
    _BF16_F16_LIMIT,
    _BF16_LIMIT,
    _F16_BLOCK,
    _WIRE_DTYPE_SET,
    _bf16_bits_to_f32,
    _blocks,
    _check_bf16_range,
    _check_f16_bits,
    _check_finite_f32,
    _f16_bits_to_f32,
    _f32_to_bf16_bits,
    _f32_to_f16_block,
    _f32_to_f16_span,
    _flat_source,
    _float32_to_f16_array,
    _run_spans,
    _Scratch,
    _source_blocks,
    _to_float32,
    dtype_name,
)


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


class _HalfWidthCodec(ElementwiseCodec):
    """The 16-bit float codecs: a span decodes in blocks of uint16 bits."""

    element_nbytes: ClassVar[int] = 2

    def _decode_span(self, buf: memoryview, out: np.ndarray, offset: int) -> None:
        bits = np.frombuffer(buf, "<u2")
        scratch = _Scratch(bits.size, cap=_F16_BLOCK)
        for start, stop in _blocks(bits.size, _F16_BLOCK):
            self._decode_block(bits[start:stop], out[start:stop], scratch, offset + start)

    def _decode_block(self, bits: np.ndarray, out: np.ndarray, scratch: _Scratch, offset: int) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Fp32Codec(_NoOptions, ElementwiseCodec):
    """float32 values, exact for float32 sources; encoding a float32 array does not copy it."""

    name: ClassVar[str] = "fp32"
    element_nbytes: ClassVar[int] = 4

    def encode(self, x: np.ndarray) -> memoryview:
        return _to_float32(_flat_source(x)).view(np.uint8).data

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
class Fp16Codec(_NoOptions, _HalfWidthCodec):
    """IEEE half precision, round to nearest even; refuses values beyond +-65504."""

    name: ClassVar[str] = "fp16"

    def encode(self, x: np.ndarray) -> memoryview:
        flat = _flat_source(x)
        if flat.dtype == np.float16:
            bits = flat.view(np.uint16)

            def check(lo: int, hi: int) -> None:
                scratch = _Scratch(hi - lo)
                for start, stop in _blocks(hi - lo):
                    _check_f16_bits(bits[lo + start : lo + stop], scratch, lo + start)

            _run_spans(flat.size, check)
            return flat.view(np.uint8).data
        return _float32_to_f16_array(flat).view(np.uint8).data

    def _decode_block(self, bits: np.ndarray, out: np.ndarray, scratch: _Scratch, offset: int) -> None:
        if out.dtype == np.float16:  # the bits are the values: copy them, refusing inf/NaN
            _check_f16_bits(bits, scratch, offset)
            out.view(np.uint16)[:] = bits
        elif out.dtype == np.float32:
            _f16_bits_to_f32(bits, out, scratch, offset)
        else:
            dst = scratch.f32[: bits.size]
            _f16_bits_to_f32(bits, dst, scratch, offset)
            out[:] = dst


@dataclass(frozen=True)
class Bf16Codec(_NoOptions, _HalfWidthCodec):
    """bfloat16: float32's exponent with an 8-bit significand, round to nearest even."""

    name: ClassVar[str] = "bf16"

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
        return out.view(np.uint8).data

    def _decode_block(self, bits: np.ndarray, out: np.ndarray, scratch: _Scratch, offset: int) -> None:
        if out.dtype == np.float32:
            _bf16_bits_to_f32(bits, out, scratch, offset)
            return
        dst = scratch.f32[: bits.size]
        _bf16_bits_to_f32(bits, dst, scratch, offset)
        if out.dtype == np.float16:  # bfloat16 reaches beyond float16's range: checked here
            _f32_to_f16_block(dst, out.view(np.uint16), scratch, offset)
        else:
            out[:] = dst
