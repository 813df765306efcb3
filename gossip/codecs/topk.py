"""The top-k codec: a tensor's largest-magnitude entries, in one of three layouts.

Plain: (uint32 index, float32 value) pairs. Packed (`packed=1`): per 65,536-element block a uint32 count, then
uint16 in-block offsets, one float32 scale and int8 values, 3 bytes per kept entry instead of 8. Packed with
Elias-Fano indices (`packed=1, elias_fano=1`): the sorted indices in about 2 + log2(n/k) bits each (under 1
byte at a 2% ratio) and the same scale and int8 values."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from numpy.typing import DTypeLike

from gossip.codecs.base import Buffer, OptionValue, _check_known_options, _is_ratio, _ratio_option
from gossip.codecs.int8 import _INT8_MAX_SCALE
from gossip.codecs.kernels import _check_finite_f32, _flat_source, _from_float32, _to_float32, dtype_name
from gossip.errors import BadSchema

_BLOCK_SHIFT = 16  # packed: offsets within blocks of 2^16 elements fit a uint16
# The ratio a swarm, a node and `murmur plan` take when none is given: one place, so that a recipe that
# leaves it out means the same to its founder and its joiners.
DEFAULT_TOPK_RATIO = 0.01


@dataclass(frozen=True)
class TopKCodec:
    """The k = ceil(ratio * n) largest-magnitude entries as (uint32 index, float32 value) pairs, or with
    `packed` as block counts, uint16 offsets and int8 values under one scale (max |kept| / 127). Packed
    values are rounded: use it where the rounding error is carried on (error feedback, CHOCO's estimates)."""

    ratio: float
    packed: bool = False
    elias_fano: bool = False  # packed only: indices Elias-Fano coded instead of block counts + uint16 offsets
    name: ClassVar[str] = "topk"
    MAX_NUMEL: ClassVar[int] = 1 << 32  # indices are uint32

    def __post_init__(self) -> None:
        r = self.ratio
        if not _is_ratio(r):
            raise ValueError(f"top-k ratio must be a number in (0, 1], got {r!r}")
        if type(self.packed) is not bool or type(self.elias_fano) is not bool:
            raise ValueError(f"top-k packed and elias_fano must be bools, got {self.packed!r}, {self.elias_fano!r}")
        if self.elias_fano and not self.packed:
            raise ValueError("top-k Elias-Fano indices come with the packed layout's int8 values: set packed too")

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> TopKCodec:
        _check_known_options(cls.name, options, ("ratio", "packed", "elias_fano"))
        ratio = _ratio_option(cls.name, options)
        flags = {key: options.get(key, 0) for key in ("packed", "elias_fano")}
        for key, flag in flags.items():
            if type(flag) is not int or flag not in (0, 1):
                raise BadSchema(f"codec 'topk' option {key!r} must be 0 or 1, got {flag!r}")
        if flags["elias_fano"] and not flags["packed"]:
            raise BadSchema("codec 'topk' option 'elias_fano' needs 'packed'")
        return cls(ratio=ratio, packed=bool(flags["packed"]), elias_fano=bool(flags["elias_fano"]))

    def options(self) -> dict[str, OptionValue]:
        # each option is written only when set, so the swarms of before keep their config hash
        options: dict[str, OptionValue] = {"ratio": float(self.ratio)}
        if self.packed:
            options["packed"] = 1
        if self.elias_fano:
            options["elias_fano"] = 1
        return options

    def k(self, numel: int) -> int:
        """How many entries the encoder sends for a tensor of `numel` elements."""
        if numel == 0:
            return 0
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def encoded_nbytes(self, numel: int) -> int:
        if self.elias_fano:
            return _elias_fano_nbytes(numel, self.k(numel))
        if self.packed:
            return _packed_nbytes(numel, self.k(numel))
        return 8 * self.k(numel)

    def accepts_nbytes(self, numel: int, nbytes: int) -> bool:
        if numel > self.MAX_NUMEL:
            return False
        if self.elias_fano:  # the size does not fix k: k is the codec's own
            return nbytes == self.encoded_nbytes(numel)
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
        if self.elias_fano:
            return _pack_elias_fano(idx, v[idx], n)
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
            dense = _unpack_elias_fano(buf, numel, self.k(numel)) if self.elias_fano else _unpack(buf, numel)
            return _from_float32(dense, np.dtype(dtype_name(dtype)))
        k = len(buf) // 8
        idx = np.frombuffer(buf, "<u4", count=k)
        vals = np.frombuffer(buf, "<f4", count=k, offset=4 * k)
        _check_indices(idx, numel)
        if k:
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
    scale, q = _int8_values(values)
    at = 4 * blocks
    out[at : at + 4].view("<f4")[0] = scale
    at += 4
    out[at : at + 2 * k].view("<u2")[:] = (idx & ((1 << _BLOCK_SHIFT) - 1)).astype(np.uint16)
    at += 2 * k
    out[at:].view(np.int8)[:] = q
    return out.data


def _int8_values(values: np.ndarray) -> tuple[np.float32, np.ndarray]:
    """One scale (max |value| / 127) and the values as int8 multiples of it."""
    top = float(np.max(np.abs(values))) if values.size else 0.0
    scale = np.float32(min(top / 127.0, _INT8_MAX_SCALE)) if top > 0 else np.float32(0.0)
    q = np.rint(values / scale) if scale > 0 else np.zeros(values.size)
    return scale, np.clip(q, -127, 127).astype(np.int8)


def _read_scale(buf: Buffer, offset: int) -> np.float32:
    scale = np.float32(np.frombuffer(buf, "<f4", count=1, offset=offset)[0])
    if not (np.isfinite(scale) and 0 <= scale <= _INT8_MAX_SCALE):
        raise BadSchema(f"packed top-k scale {float(scale)!r} is not a finite non-negative float32 in range")
    return scale


def _check_indices(idx: np.ndarray, numel: int) -> None:
    if idx.size:
        if int(idx[-1]) >= numel:
            raise BadSchema(f"top-k index {int(idx[-1])} out of range for {numel} elements")
        if idx.size > 1 and not bool(np.all(idx[1:] > idx[:-1])):
            raise BadSchema("top-k indices are not strictly increasing")


def _low_bits(numel: int, k: int) -> int:
    """Elias-Fano's split: each index keeps its low floor(log2(numel / k)) bits apart."""
    return max(0, (numel // k).bit_length() - 1) if k else 0


def _elias_fano_sizes(numel: int, k: int) -> tuple[int, int, int]:
    """(low bits per index, bits of the unary high parts, bytes of the whole payload)."""
    low = _low_bits(numel, k)
    high_bits = k + ((numel - 1) >> low) + 1 if numel else 0
    return low, high_bits, 4 + (high_bits + 7) // 8 + (k * low + 7) // 8 + k


def _elias_fano_nbytes(numel: int, k: int) -> int:
    """The float32 scale, the high parts in unary (one set bit per index), the low bits, k int8 values."""
    return _elias_fano_sizes(numel, k)[2]


def _pack_elias_fano(idx: np.ndarray, values: np.ndarray, numel: int) -> memoryview:
    """Sorted indices `idx` and their (finite float32) values in the Elias-Fano layout."""
    k = idx.size
    low, high_bits, nbytes = _elias_fano_sizes(numel, k)
    out = np.zeros(nbytes, np.uint8)
    scale, q = _int8_values(values)
    out[:4].view("<f4")[0] = scale
    idx = idx.astype(np.int64)
    unary = np.zeros(high_bits, np.uint8)
    unary[(idx >> low) + np.arange(k)] = 1  # the i-th set bit sits at high part + i
    at = 4 + (high_bits + 7) // 8
    out[4:at] = np.packbits(unary, bitorder="little")
    if low:
        bits = ((idx[:, None] >> np.arange(low)) & 1).astype(np.uint8)
        out[at : at + (k * low + 7) // 8] = np.packbits(bits.ravel(), bitorder="little")
    out[nbytes - k :].view(np.int8)[:] = q
    return out.data


def _unpack_elias_fano(buf: Buffer, numel: int, k: int) -> np.ndarray:
    """The float32 tensor an Elias-Fano payload (of the accepted size) describes; BadSchema if malformed."""
    low, high_bits, nbytes = _elias_fano_sizes(numel, k)
    scale = _read_scale(buf, 0)
    at = 4 + (high_bits + 7) // 8
    raw = np.frombuffer(buf, np.uint8, count=nbytes)
    ones = np.flatnonzero(np.unpackbits(raw[4:at], bitorder="little")[:high_bits])
    if ones.size != k:
        raise BadSchema(f"Elias-Fano top-k holds {ones.size} high parts for {k} entries")
    idx = (ones - np.arange(k)) << low
    if low:
        bits = np.unpackbits(raw[at : at + (k * low + 7) // 8], bitorder="little")[: k * low].reshape(k, low)
        idx |= bits.astype(np.int64) @ (np.int64(1) << np.arange(low, dtype=np.int64))
    _check_indices(idx, numel)
    out = np.zeros(numel, np.float32)
    out[idx] = raw[nbytes - k :].view(np.int8).astype(np.float32) * scale
    return out


def _unpack(buf: Buffer, numel: int) -> np.ndarray:
    """The float32 tensor a packed payload (of an accepted size) describes; BadSchema if it is malformed."""
    blocks = _blocks(numel)
    k = (len(buf) - _packed_nbytes(numel, 0)) // 3
    counts = np.frombuffer(buf, "<u4", count=blocks).astype(np.int64)
    if int(counts.sum()) != k:
        raise BadSchema(f"packed top-k block counts add up to {int(counts.sum())}, the payload holds {k} entries")
    at = 4 * blocks
    scale = _read_scale(buf, at)
    offsets = np.frombuffer(buf, "<u2", count=k, offset=at + 4).astype(np.int64)
    values = np.frombuffer(buf, np.int8, count=k, offset=at + 4 + 2 * k)
    starts = np.repeat(np.arange(blocks, dtype=np.int64) << _BLOCK_SHIFT, counts)
    idx = starts + offsets
    _check_indices(idx, numel)
    out = np.zeros(numel, np.float32)
    out[idx] = values.astype(np.float32) * scale
    return out
