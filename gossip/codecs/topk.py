"""The top-k codec: the largest-magnitude entries of a tensor as (uint32 index, float32 value) pairs, or
packed (`packed=1`): per 65,536-element block a uint32 count, then uint16 in-block offsets, one float32
scale and int8 values, 3 bytes per kept entry instead of 8."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from numpy.typing import DTypeLike

from gossip.codecs.base import Buffer, OptionValue, _check_known_options, _is_ratio
from gossip.codecs.int8 import _INT8_MAX_SCALE
from gossip.codecs.kernels import _check_finite_f32, _flat_source, _from_float32, _to_float32, dtype_name
from gossip.errors import BadSchema

_BLOCK_SHIFT = 16  # packed: offsets within blocks of 2^16 elements fit a uint16


@dataclass(frozen=True)
class TopKCodec:
    """The k = ceil(ratio * n) largest-magnitude entries as (uint32 index, float32 value) pairs, or with
    `packed` as block counts, uint16 offsets and int8 values under one scale (max |kept| / 127). Packed
    values are rounded: use it where the rounding error is carried on (error feedback, CHOCO's estimates)."""

    ratio: float
    packed: bool = False
    name: ClassVar[str] = "topk"
    MAX_NUMEL: ClassVar[int] = 1 << 32  # indices are uint32

    def __post_init__(self) -> None:
        r = self.ratio
        if not _is_ratio(r):
            raise ValueError(f"top-k ratio must be a number in (0, 1], got {r!r}")
        if type(self.packed) is not bool:
            raise ValueError(f"top-k packed must be a bool, got {self.packed!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> TopKCodec:
        _check_known_options(cls.name, options, ("ratio", "packed"))
        if "ratio" not in options:
            raise BadSchema("codec 'topk' needs option 'ratio'")
        ratio = options["ratio"]
        if not _is_ratio(ratio):
            raise BadSchema(f"codec 'topk' option 'ratio' must be a number in (0, 1], got {ratio!r}")
        packed = options.get("packed", 0)
        if type(packed) is not int or packed not in (0, 1):
            raise BadSchema(f"codec 'topk' option 'packed' must be 0 or 1, got {packed!r}")
        return cls(ratio=float(ratio), packed=bool(packed))

    def options(self) -> dict[str, OptionValue]:
        # unpacked, the options are what they always were, so existing swarms keep their config hash
        return {"ratio": float(self.ratio), "packed": 1} if self.packed else {"ratio": float(self.ratio)}

    def k(self, numel: int) -> int:
        """How many entries the encoder sends for a tensor of `numel` elements."""
        if numel == 0:
            return 0
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def encoded_nbytes(self, numel: int) -> int:
        if self.packed:
            return _packed_nbytes(numel, self.k(numel))
        return 8 * self.k(numel)

    def accepts_nbytes(self, numel: int, nbytes: int) -> bool:
        if numel > self.MAX_NUMEL:
            return False
        if self.packed:  # a manifest fixes k through the size: any k up to numel
            rest = nbytes - _packed_nbytes(numel, 0)
            return rest >= 0 and rest % 3 == 0 and rest // 3 <= numel
        return nbytes % 8 == 0 and nbytes // 8 <= numel

    def encode(self, x: np.ndarray) -> memoryview:
        flat = _flat_source(x)
        n = flat.size
        if n > self.MAX_NUMEL:
            raise ValueError(f"top-k indices are uint32: at most 2^32 elements, got {n}")
        v = _to_float32(flat)
        k = self.k(n)
        idx: np.ndarray
        if k == n:
            idx = np.arange(n, dtype=np.uint32)
        elif k:
            idx = np.argpartition(np.abs(v), n - k)[n - k :]
            idx.sort()
        else:
            idx = np.empty(0, np.uint32)
        if self.packed:
            return _pack(idx, v[idx], n)
        out = np.empty(8 * k, np.uint8)
        out[: 4 * k].view("<u4")[:] = idx
        out[4 * k :].view("<f4")[:] = v[idx]
        return out.data

    def decode(self, buf: Buffer, numel: int, dtype: DTypeLike = np.float32) -> np.ndarray:
        if not self.accepts_nbytes(numel, len(buf)):
            raise BadSchema(f"top-k payload of {len(buf)} bytes does not fit {numel} elements")
        if self.packed:
            return _from_float32(_unpack(buf, numel), np.dtype(dtype_name(dtype)))
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


def _blocks(numel: int) -> int:
    return -(-numel >> _BLOCK_SHIFT)


def _packed_nbytes(numel: int, k: int) -> int:
    """Block counts (uint32 each), the float32 scale, then k uint16 offsets and k int8 values."""
    return 4 * _blocks(numel) + 4 + 3 * k


def _pack(idx: np.ndarray, values: np.ndarray, numel: int) -> memoryview:
    """Sorted indices `idx` and their (finite float32) values in the packed layout."""
    k, blocks = idx.size, _blocks(numel)
    out = np.empty(_packed_nbytes(numel, k), np.uint8)
    counts = np.bincount((idx >> _BLOCK_SHIFT).astype(np.int64), minlength=blocks) if k else np.zeros(blocks, np.int64)
    out[: 4 * blocks].view("<u4")[:] = counts
    top = float(np.max(np.abs(values))) if k else 0.0
    scale = np.float32(min(top / 127.0, _INT8_MAX_SCALE)) if top > 0 else np.float32(0.0)
    at = 4 * blocks
    out[at : at + 4].view("<f4")[0] = scale
    at += 4
    out[at : at + 2 * k].view("<u2")[:] = (idx & ((1 << _BLOCK_SHIFT) - 1)).astype(np.uint16)
    at += 2 * k
    q = np.rint(values / scale) if scale > 0 else np.zeros(k)
    out[at:].view(np.int8)[:] = np.clip(q, -127, 127).astype(np.int8)
    return out.data


def _unpack(buf: Buffer, numel: int) -> np.ndarray:
    """The float32 tensor a packed payload (of an accepted size) describes; BadSchema if it is malformed."""
    blocks = _blocks(numel)
    k = (len(buf) - _packed_nbytes(numel, 0)) // 3
    counts = np.frombuffer(buf, "<u4", count=blocks).astype(np.int64)
    if int(counts.sum()) != k:
        raise BadSchema(f"packed top-k block counts add up to {int(counts.sum())}, the payload holds {k} entries")
    at = 4 * blocks
    scale = np.frombuffer(buf, "<f4", count=1, offset=at)
    if not (np.isfinite(scale[0]) and 0 <= scale[0] <= _INT8_MAX_SCALE):
        raise BadSchema(f"packed top-k scale {float(scale[0])!r} is not a finite non-negative float32 in range")
    offsets = np.frombuffer(buf, "<u2", count=k, offset=at + 4).astype(np.int64)
    values = np.frombuffer(buf, np.int8, count=k, offset=at + 4 + 2 * k)
    starts = np.repeat(np.arange(blocks, dtype=np.int64) << _BLOCK_SHIFT, counts)
    idx = starts + offsets
    if k:
        if int(idx[-1]) >= numel:
            raise BadSchema(f"top-k index {int(idx[-1])} out of range for {numel} elements")
        if k > 1 and not bool(np.all(idx[1:] > idx[:-1])):
            raise BadSchema("top-k indices are not strictly increasing")
    out = np.zeros(numel, np.float32)
    out[idx] = values.astype(np.float32) * scale[0]
    return out
