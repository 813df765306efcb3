"""The top-k codec: the largest-magnitude entries of a tensor as (uint32 index, float32 value) pairs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from numpy.typing import DTypeLike

from gossip.codecs.base import Buffer, OptionValue, _check_known_options, _is_ratio
from gossip.codecs.kernels import _check_finite_f32, _flat_source, _from_float32, _to_float32, dtype_name
from gossip.errors import BadSchema


@dataclass(frozen=True)
class TopKCodec:
    """The k = ceil(ratio * n) largest-magnitude entries as (uint32 index, float32 value) pairs."""

    ratio: float
    name: ClassVar[str] = "topk"
    MAX_NUMEL: ClassVar[int] = 1 << 32  # indices are uint32

    def __post_init__(self) -> None:
        r = self.ratio
        if not _is_ratio(r):
            raise ValueError(f"top-k ratio must be a number in (0, 1], got {r!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> TopKCodec:
        _check_known_options(cls.name, options, ("ratio",))
        if "ratio" not in options:
            raise BadSchema("codec 'topk' needs option 'ratio'")
        ratio = options["ratio"]
        if not _is_ratio(ratio):
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
        idx: np.ndarray
        if k == n:
            idx = np.arange(n, dtype=np.uint32)
        elif k:
            idx = np.argpartition(np.abs(v), n - k)[n - k :]
            idx.sort()
        else:
            idx = np.empty(0, np.uint32)
        out[: 4 * k].view("<u4")[:] = idx
        out[4 * k :].view("<f4")[:] = v[idx]
        return out.data

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
